"""Load (and write) a Hugging Face model folder: config.json, safetensors, tokenizer files.

Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM. `save_hf_folder` writes
the same layout back (sharded safetensors with an index), which lets tests round-trip and
exports the bundled GGUF as a float32 Hugging Face folder.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import safetensors
import tokenizers

from splitserve.errors import ModelLoadError
from splitserve.model.config import ModelConfig, RopeScaling
from splitserve.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                  "Qwen2ForCausalLM": "qwen2"}
_HF_CLASSES = {arch: cls for cls, arch in _ARCHITECTURES.items()}
_INDEX = "model.safetensors.index.json"
WeightsFn = Callable[[], Iterator[tuple[str, "torch.Tensor"]]]


def read_json(path: str, required: bool = True) -> dict:
    if not os.path.isfile(path):
        if required:
            raise ModelLoadError(f"{path} not found; a Hugging Face model folder needs it")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None


def _id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


# -- config ------------------------------------------------------------------------------
def _rope_scaling(d: dict | None, where: str) -> RopeScaling | None:
    if not d:
        return None
    kind = d.get("rope_type", d.get("type"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ModelLoadError(f"{where}: rope_scaling type {kind!r} is not supported; "
                             "supported: llama3")
    return RopeScaling(factor=float(d["factor"]), low_freq_factor=float(d["low_freq_factor"]),
                       high_freq_factor=float(d["high_freq_factor"]),
                       original_max_position_embeddings=int(d["original_max_position_embeddings"]))


def _sliding_window(d: dict, arch: str, max_pos: int) -> int | None:
    window = d.get("sliding_window")
    if arch == "llama" or (arch == "qwen2" and not d.get("use_sliding_window", False)):
        return None
    # A window covering every position is full attention; say so with None.
    return None if window is None or window >= max_pos else int(window)


def config_from_hf(d: dict, name: str, generation: dict | None = None,
                   where: str = "config.json") -> ModelConfig:
    archs = d.get("architectures") or []
    if not archs or archs[0] not in _ARCHITECTURES:
        raise ModelLoadError(f"{where}: architecture {archs[0] if archs else None!r} is not "
                             f"supported; supported: {', '.join(_ARCHITECTURES)}")
    arch = _ARCHITECTURES[archs[0]]
    try:
        heads, hidden = int(d["num_attention_heads"]), int(d["hidden_size"])
        max_pos = int(d.get("max_position_embeddings", 2048))
        eos = _id_list(d.get("eos_token_id")) + _id_list((generation or {}).get("eos_token_id"))
        return ModelConfig(
            name=name, architecture=arch, vocab_size=int(d["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta", 10000.0)), max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2's q/k/v projections always carry a bias; Llama's only when configured.
            attention_bias=arch == "qwen2" or bool(d.get("attention_bias", False)),
            rope_scaling=_rope_scaling(d.get("rope_scaling"), where),
            sliding_window=_sliding_window(d, arch, max_pos),
            bos_token_id=d.get("bos_token_id"), eos_token_ids=tuple(dict.fromkeys(eos)))
    except KeyError as exc:
        raise ModelLoadError(f"{where}: missing required key {exc}") from None


def config_to_hf(cfg: ModelConfig, torch_dtype: str = "float32") -> dict:
    d = {"architectures": [_HF_CLASSES[cfg.architecture]], "model_type": cfg.architecture,
         "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
         "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
         "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
         "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
         "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
         "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
         "hidden_act": "silu", "bos_token_id": cfg.bos_token_id,
         "eos_token_id": list(cfg.eos_token_ids), "torch_dtype": torch_dtype,
         "rope_scaling": None, "sliding_window": cfg.sliding_window}
    if cfg.rope_scaling is not None:
        d["rope_scaling"] = {"rope_type": "llama3", **vars(cfg.rope_scaling)}
    if cfg.architecture == "qwen2":
        d["use_sliding_window"] = cfg.sliding_window is not None
    return d


# -- weights -----------------------------------------------------------------------------
def _safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, _INDEX)
    if os.path.isfile(index):
        names = dict.fromkeys(read_json(index).get("weight_map", {}).values())
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    files = [os.path.join(folder, n) for n in names]
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights found (.bin checkpoints "
                             "are not supported)")
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ModelLoadError(f"{folder}: weight shard {missing[0]} listed in {_INDEX} is missing")
    return files


def iter_safetensors(files: list[str], tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safetensors.safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                # Tied checkpoints sometimes store lm_head too; the contract is "absent".
                if key.endswith("rotary_emb.inv_freq") or (tied and key == "lm_head.weight"):
                    continue
                yield key, f.get_tensor(key)


# -- tokenizer ---------------------------------------------------------------------------
def _chat_template(folder: str, tk_config: dict) -> str | None:
    template = tk_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    return template


def tokenizer_from_hf(folder: str, config: ModelConfig) -> Tokenizer:
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path} not found; only fast (tokenizer.json) tokenizers are "
                             "supported")
    try:
        tk = tokenizers.Tokenizer.from_file(path)
    except Exception as exc:  # the Rust side raises a bare Exception on bad JSON
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    tk_config = read_json(os.path.join(folder, "tokenizer_config.json"), required=False)
    bos = config.bos_token_id
    if bos is None and isinstance(tk_config.get("bos_token"), str):
        bos = tk.token_to_id(tk_config["bos_token"])
    return Tokenizer(tk, bos_token_id=bos, eos_token_ids=config.eos_token_ids,
                     chat_template=_chat_template(folder, tk_config),
                     add_bos=bool(tk_config.get("add_bos_token", False)), name=config.name)


# -- entry points ------------------------------------------------------------------------
def load_hf_folder(folder: str) -> tuple[ModelConfig, Tokenizer, WeightsFn]:
    folder = os.path.abspath(folder)
    where = os.path.join(folder, "config.json")
    generation = read_json(os.path.join(folder, "generation_config.json"), required=False)
    config = config_from_hf(read_json(where), os.path.basename(folder), generation, where)
    tokenizer = tokenizer_from_hf(folder, config)
    files = _safetensors_files(folder)
    logger.info("HF folder %s: %s, %d layers, %d weight files", folder, config.architecture,
                config.num_layers, len(files))
    return config, tokenizer, lambda: iter_safetensors(files, config.tie_word_embeddings)


def save_hf_folder(source, folder: str, max_shard_bytes: int = 2 * 1024**3) -> None:
    """Write `source` (a ModelSource) as a Hugging Face folder; weights keep their dtype.
    More than one shard gets the standard model-0000i-of-0000n names and an index."""
    os.makedirs(folder, exist_ok=True)
    shards, current, size, dtype = [], {}, 0, "float32"
    for name, tensor in source.weights():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = tensor.contiguous(), size + nbytes
        dtype = str(tensor.dtype).removeprefix("torch.")
    shards.append(current)
    _write_shards(folder, shards)
    _write_json(os.path.join(folder, "config.json"), config_to_hf(source.config, dtype))
    _write_json(os.path.join(folder, "generation_config.json"),
                {"bos_token_id": source.config.bos_token_id,
                 "eos_token_id": list(source.config.eos_token_ids)})
    source.tokenizer.save_hf(folder)


def _write_shards(folder: str, shards: list[dict[str, torch.Tensor]]) -> None:
    import safetensors.torch
    if len(shards) == 1:
        safetensors.torch.save_file(shards[0], os.path.join(folder, "model.safetensors"),
                                    metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        safetensors.torch.save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    _write_json(os.path.join(folder, _INDEX),
                {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=2)
