"""Read a GGUF file (llama.cpp's format): model config, tokenizer and weights.

The header (key/values and tensor infos) is parsed here with `struct` rather than with
`gguf.GGUFReader`: the reader builds a numpy view per array element, seconds of work on a
vocabulary and merge list of tens of thousands of entries (docs/tuning.md).
Dequantization is left to `gguf.quants`.

Weights come out under Hugging Face names with llama.cpp's Q/K row permutation undone, so
everything downstream sees one layout whatever the file format.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from splitserve.errors import ModelLoadError
from splitserve.model.config import ModelConfig
from splitserve.model.tokenizer import Tokenizer, tokenizer_from_gguf_metadata

if TYPE_CHECKING:   # torch loads with the weights: a front-end reads config and tokenizer only
    import torch

logger = logging.getLogger(__name__)

_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32
# GGUF architecture name -> ModelConfig.architecture. llama.cpp converts Mistral as "llama".
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
# Only llama.cpp's "llama" conversion permutes Q/K rows (for its interleaved RoPE); qwen2
# uses NeoX-style RoPE and is stored in Hugging Face order.
_PERMUTED_QK = {"llama"}

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight",
                "ffn_norm.weight": "post_attention_layernorm.weight",
                "attn_output.weight": "self_attn.o_proj.weight",
                "ffn_gate.weight": "mlp.gate_proj.weight",
                "ffn_up.weight": "mlp.up_proj.weight",
                "ffn_down.weight": "mlp.down_proj.weight",
                **{f"attn_{p}.{kind}": f"self_attn.{p}_proj.{kind}"
                   for p in "qkv" for kind in ("weight", "bias")}}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]          # numpy order: GGUF's dims reversed, so (out, in)
    qtype: GGMLQuantizationType
    offset: int                     # absolute byte offset of the data in the file


@dataclass(frozen=True)
class GGUFFile:
    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]


# -- header parsing ----------------------------------------------------------------------
class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        start, self.pos = self.pos, self.pos + n
        return bytes(self.buf[start:self.pos]).decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _SCALAR_FORMATS and item_type != 7:
                dtype = np.dtype(_SCALAR_FORMATS[item_type])
                arr = np.frombuffer(self.buf, dtype, count, self.pos)
                self.pos += dtype.itemsize * count
                return arr.tolist()
            return [self.value(item_type) for _ in range(count)]
        if vtype not in _SCALAR_FORMATS:
            raise ModelLoadError(f"GGUF metadata value type {vtype} is not valid")
        value = self.unpack(_SCALAR_FORMATS[vtype])
        # float32 keys (e.g. rms eps) read back as 9.999999747e-06; the shortest decimal
        # that round-trips in float32 (1e-05) is what the source config said.
        return float(str(np.float32(value))) if vtype == 6 else value


def read_gguf(path: str) -> GGUFFile:
    """Parse the header of a GGUF v2/v3 little-endian file; tensor data stays on disk."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                return _parse_header(path, _Cursor(view))
            finally:
                view.release()      # mmap refuses to close while a view is exported
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from None


def _parse_header(path: str, cur: _Cursor) -> GGUFFile:
    if bytes(cur.buf[:4]) != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (need 2 or 3; "
                             "big-endian files are not supported)")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
        infos.append((name, tuple(reversed(dims)), cur.unpack("<I"), cur.unpack("<Q")))
    align = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // align) * align
    tensors = {}
    for name, shape, qtype, offset in infos:
        try:
            qtype = GGMLQuantizationType(qtype)
        except ValueError:
            raise ModelLoadError(f"{path}: tensor {name} has unknown GGML type {qtype}") from None
        tensors[name] = GGUFTensorInfo(name, shape, qtype, data_start + offset)
    return GGUFFile(path, metadata, tensors)


# -- config ------------------------------------------------------------------------------
def config_from_gguf(gf: GGUFFile, name: str) -> ModelConfig:
    md = gf.metadata
    arch = md.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(f"{gf.path}: GGUF architecture {arch!r} is not supported; "
                             f"supported: {', '.join(_ARCHITECTURES)}")
    if "rope_freqs.weight" in gf.tensors or md.get(f"{arch}.rope.scaling.type", "none") != "none":
        raise ModelLoadError(f"{gf.path}: RoPE scaling in GGUF files is not supported; "
                             "load the Hugging Face folder of this model instead")
    try:
        return _config(md, arch, gf, name)
    except KeyError as exc:
        raise ModelLoadError(f"{gf.path}: GGUF metadata key {exc} is missing") from None


def _config(md: dict, arch: str, gf: GGUFFile, name: str) -> ModelConfig:
    heads = int(md[f"{arch}.attention.head_count"])
    hidden = int(md[f"{arch}.embedding_length"])
    eos = [md[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if k in md]
    return ModelConfig(
        name=name, architecture=_ARCHITECTURES[arch],
        vocab_size=int(md.get(f"{arch}.vocab_size") or len(md["tokenizer.ggml.tokens"])),
        hidden_size=hidden, intermediate_size=int(md[f"{arch}.feed_forward_length"]),
        num_layers=int(md[f"{arch}.block_count"]), num_heads=heads,
        num_kv_heads=int(md.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(md.get(f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(md[f"{arch}.attention.layer_norm_rms_epsilon"]),
        rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(md[f"{arch}.context_length"]),
        tie_word_embeddings="output.weight" not in gf.tensors,
        attention_bias="blk.0.attn_q.bias" in gf.tensors,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos)))


# -- weights -----------------------------------------------------------------------------
def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama equivalent")


@functools.lru_cache(maxsize=None)
def _can_dequantize(qtype: GGMLQuantizationType) -> bool:
    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _check_tensors(gf: GGUFFile) -> None:
    for info in gf.tensors.values():
        hf_name(info.name)
        if not _can_dequantize(info.qtype):
            raise ModelLoadError(f"{gf.path}: tensor {info.name} uses quantization "
                                 f"{info.qtype.name}, which gguf.quants cannot dequantize")


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Invert llama.cpp's permutation. Per head it stores rows as interleaved pairs
    (x0, x_{d/2}, x1, x_{d/2+1}, ...); Hugging Face keeps the two halves contiguous.
    w: (n_heads * head_dim, in) or a bias (n_heads * head_dim,)."""
    rest = w.shape[1:]
    return (w.reshape(n_heads, -1, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous())


def _read_tensor(mm, info: GGUFTensorInfo) -> torch.Tensor:
    block_size, type_size = GGML_QUANT_SIZES[info.qtype]
    byte_shape = (*info.shape[:-1], info.shape[-1] // block_size * type_size)
    raw = np.frombuffer(mm, np.uint8, int(np.prod(byte_shape)), info.offset).reshape(byte_shape)
    # dequantize returns a fresh float32 array except for F32, which is a view of the map.
    import torch
    values = np.array(dequantize(raw, info.qtype), dtype=np.float32, copy=True)
    return torch.from_numpy(values.reshape(info.shape))


def iter_gguf_weights(gf: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, float32 tensor), one tensor dequantized at a time."""
    permuted = gf.metadata.get("general.architecture") in _PERMUTED_QK
    with open(gf.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for info in gf.tensors.values():
            name = hf_name(info.name)
            tensor = _read_tensor(mm, info)
            if permuted and ".q_proj." in name:
                tensor = unpermute_qk(tensor, config.num_heads)
            elif permuted and ".k_proj." in name:
                tensor = unpermute_qk(tensor, config.num_kv_heads)
            yield name, tensor


# -- entry points ------------------------------------------------------------------------
def load_gguf(path: str, name: str | None = None
              ) -> tuple[ModelConfig, Tokenizer, Callable[[], Iterator[tuple[str, torch.Tensor]]]]:
    """(config, tokenizer, weights) for a GGUF file; weights() re-reads the file lazily."""
    gf = read_gguf(path)
    name = name or os.path.splitext(os.path.basename(path))[0]
    config = config_from_gguf(gf, name)
    _check_tensors(gf)
    tokenizer = tokenizer_from_gguf_metadata(gf.metadata, name)
    logger.info("GGUF %s: %s, %d layers, %d tensors", path, config.architecture,
                config.num_layers, len(gf.tensors))
    return config, tokenizer, lambda: iter_gguf_weights(gf, config)


@functools.lru_cache(maxsize=4)
def load_gguf_tokenizer(path: str) -> Tokenizer:
    """Tokenizer only, cached per process: the tiny test model reuses the bundled one."""
    name = os.path.splitext(os.path.basename(path))[0]
    return tokenizer_from_gguf_metadata(read_gguf(path).metadata, name)
