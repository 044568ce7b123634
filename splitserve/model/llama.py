"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

Tokens of a step arrive flattened: (T,) ids and positions for all sequences together, so
every linear layer runs once per step on the whole batch. Only attention is per-sequence
(splitserve/model/attention.py).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.errors import ModelLoadError
from splitserve.model import fused
from splitserve.model.attention import AttentionMetadata, paged_attention
from splitserve.model.config import ModelConfig
from splitserve.model.packed import pack_linears, packed_linear
from splitserve.model.quant import quantize_linears, quantized_linear
from splitserve.platforms import platform_for
from splitserve.platforms.base import Platform


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:   # one fused kernel
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Hugging Face's order: normalise in float32, round to x's dtype, then scale.
        # F.rms_norm scales before rounding (bfloat16 results differ by up to 1 ulp), and its
        # bfloat16 path is slower than these five kernels on a prefill (docs/tuning.md).
        x32 = x.float()
        rms = torch.rsqrt(x32.square().mean(-1, keepdim=True).add_(self.eps))
        return x32.mul_(rms).to(x.dtype).mul_(self.weight)


class Rotary:
    """RoPE in the rotate-half layout; cos/sin computed once per step from the positions and
    shared by every layer."""

    def __init__(self, cfg: ModelConfig):
        d = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        if cfg.rope_scaling is not None:
            inv_freq = _llama3_scale(inv_freq, cfg.rope_scaling)
        self.inv_freq = inv_freq.float()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """-> cos (T, 1, D) and sin with its first half negated (T, 1, D): then
        rotate_half(x) * sin = [x2, x1] * sin (splitserve/model/fused.py: rope_)."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)    # (T, D/2)
        cos, sin = freqs.cos(), freqs.sin()
        return (torch.cat([cos, cos], dim=-1).unsqueeze(1).to(dtype),
                torch.cat([-sin, sin], dim=-1).unsqueeze(1).to(dtype))


def _llama3_scale(inv_freq: torch.Tensor, rs) -> torch.Tensor:
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    mid = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.index = index
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # q, k, v fused into one matmul; gate and up likewise.
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, delta, cos, sin, kv_cache, meta: AttentionMetadata):
        """x (T, hidden) the residual stream, updated in place, and delta the previous layer's
        output still to be added to it (None before the first layer) -> (x, this layer's
        output). The add is deferred so it fuses with the norm that follows it."""
        cfg = self.cfg
        t, h, kvh = x.shape[0], cfg.num_heads, cfg.num_kv_heads
        qkv = self.qkv_proj(fused.add_rms_norm(x, delta, self.input_layernorm))
        qkv = qkv.view(t, h + 2 * kvh, cfg.head_dim)
        fused.rope_(qkv[:, :h + kvh], cos, sin)         # q and k rotated together, in place
        # (T, H, D) queries and (T, 2, KVH, D) keys|values, both views of qkv
        q, kv = qkv[:, :h], qkv[:, h:].unflatten(1, (2, kvh))
        attn = paged_attention(q, kv, kv_cache, self.index, meta, self.scale)
        mlp_in = fused.add_rms_norm(x, self.o_proj(attn.reshape(t, cfg.q_size)),
                                    self.post_attention_layernorm)
        return x, self.down_proj(fused.silu_mul(self.gate_up_proj(mlp_in)))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary | None = None):
        super().__init__()
        self.cfg = cfg
        # its weight given: not initialized (load_weights writes it)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = rotary or Rotary(cfg)
        self.quantization: str | None = None
        self.packed = False

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions (T,) -> final hidden states (T, hidden)."""
        x = self.embed_tokens(input_ids)                   # (T, hidden), ours to update
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        delta = None
        for layer in self.layers:
            x, delta = layer(x, delta, cos, sin, kv_cache, meta)
        return fused.add_rms_norm(x, delta, self.norm)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32."""
        if self.lm_head is None:   # tied, neither quantized nor packed
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def quantize(self, method: str) -> None:
        """Replace every linear layer, the (tied) lm_head included, by its quantized form
        (splitserve/model/quant.py). Runs after load_weights, so the fused qkv and gate_up
        weights are quantized whole; the embedding lookup stays in float."""
        quantize_linears(self, method)
        if self.lm_head is None:
            self.lm_head = quantized_linear(method, self.embed_tokens.weight)
        self.quantization = method

    def pack(self) -> None:
        """Reorder every float linear weight, the (tied) lm_head included, into oneDNN's
        blocked layout, or float32 ones on one thread into the C kernel's tiles
        (splitserve/model/packed.py). A tied lm_head gets its own packed copy: the embedding
        lookup still reads the plain table."""
        pack_linears(self)
        if self.lm_head is None:
            self.lm_head = packed_linear(self.embed_tokens.weight)
        self.packed = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            target, rows = _map_name(self.cfg, name)
            if target is None:
                continue
            if target not in params:
                raise ModelLoadError(f"weight {name} has no place in the model")
            dst = params[target].data
            dst = dst if rows is None else dst[rows[0]:rows[1]]
            if dst.shape != tensor.shape:
                raise ModelLoadError(f"weight {name}: shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(name)
        missing = set(_expected_names(self.cfg)) - loaded
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")


def _map_name(cfg: ModelConfig, name: str):
    """HF name -> (our parameter name, row range inside a fused parameter or None)."""
    if name.endswith("rotary_emb.inv_freq"):
        return None, None
    name = name.removeprefix("model.")
    q, kv, ff = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    fused = {
        "self_attn.q_proj": ("qkv_proj", (0, q)),
        "self_attn.k_proj": ("qkv_proj", (q, q + kv)),
        "self_attn.v_proj": ("qkv_proj", (q + kv, q + 2 * kv)),
        "mlp.gate_proj": ("gate_up_proj", (0, ff)),
        "mlp.up_proj": ("gate_up_proj", (ff, 2 * ff)),
        "self_attn.o_proj": ("o_proj", None),
        "mlp.down_proj": ("down_proj", None),
    }
    if name.startswith("layers."):
        _, idx, rest = name.split(".", 2)
        module, _, kind = rest.rpartition(".")
        if module in fused:
            target, rows = fused[module]
            return f"layers.{idx}.{target}.{kind}", rows
        return f"layers.{idx}.{rest}", None
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None, None
    return name, None


def _expected_names(cfg: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{m}_proj.weight" for m in "qkvo"]
        names += [p + f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")]
        if cfg.attention_bias:
            names += [p + f"self_attn.{m}_proj.bias" for m in "qkv"]
    return names


def build_model(cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]],
                dtype: torch.dtype, quantization: str | None = None,
                pack: bool = True, platform: Platform | None = None) -> LlamaModel:
    """The model on the platform's device (default: the CPU's) with its linear kernels: on
    the CPU quantized weights if `quantization`, else packed ones where oneDNN supports
    `dtype` and `pack` is set, else plain nn.Linear (platforms/)."""
    # On the meta device, modules are built without memory; nothing that computes runs there
    # (torch computes on meta with Python decompositions, whose imports of torch._dynamo and
    # sympy cost ~2.6 s a process): embeddings are not initialized, RoPE is computed on the
    # CPU, and each parameter is replaced by a CPU tensor of its shape (not to_empty's
    # empty_like of a meta tensor) in `dtype`: each streamed tensor is rounded as it is
    # copied in, so the model is held once, never also in float32.
    rotary = Rotary(cfg)
    with torch.device("meta"):
        model = LlamaModel(cfg, rotary)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(torch.empty(p.shape, dtype=dtype),
                                                         p.requires_grad))
    model.load_weights(weights)
    model = (platform or platform_for("cpu")).prepare_model(model, dtype, quantization, pack)
    model.rotary.inv_freq = model.rotary.inv_freq.to(model.embed_tokens.weight.device)
    return model
