"""A plain PyTorch forward of a model's shapes, to time against the engine's prefill.

What a Llama forward costs on this machine without the engine: one nn.Linear per
projection (q, k, v, o, gate, up, down) with random weights in the given dtype, nn.RMSNorm,
rotary embeddings, and F.scaled_dot_product_attention(is_causal=True) over the whole
prompt; no paged KV cache, no scheduler, no sampling. A target set on another machine can
be compared through it: the engine should be at least as fast as this here.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.model.config import ModelConfig


class _Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q = nn.Linear(h, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.gate = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.norm1, self.norm2 = nn.RMSNorm(h, cfg.rms_norm_eps), nn.RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t, y = x.shape[0], self.norm1(x)
        q = _rotate(self.q(y).view(t, self.heads, self.head_dim), cos, sin)
        k = _rotate(self.k(y).view(t, self.kv_heads, self.head_dim), cos, sin)
        v = self.v(y).view(t, self.kv_heads, self.head_dim)
        a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(0, 1).reshape(t, -1))
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def prefill_tok_s(cfg: ModelConfig, dtype: torch.dtype, length: int, repeats: int) -> float:
    """Tokens per second of the median of `repeats` forwards over a `length`-token prompt."""
    torch.manual_seed(0)
    layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers)).to(dtype).eval()
    half = cfg.head_dim // 2
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(half, dtype=torch.float32) / half)
    angles = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = (f(angles)[:, None, :].to(dtype) for f in (torch.cos, torch.sin))
    x = torch.randn(length, cfg.hidden_size, dtype=dtype)
    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):      # the first forward warms up, unmeasured
            start = time.perf_counter()
            y = x
            for layer in layers:
                y = layer(y, cos, sin)
            if i:
                times.append(time.perf_counter() - start)
    return length / sorted(times)[len(times) // 2]
