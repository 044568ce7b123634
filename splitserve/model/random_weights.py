"""Seeded random weights for a ModelConfig: what tiny-random and `--load-format dummy` run.

The stream is Hugging Face-named float32 CPU tensors, one at a time, so a model of any size
is built without a second copy. The same (config, seed) gives the same tensors on every call
and on every machine: one CPU generator, drawn in a fixed order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from splitserve.model.config import ModelConfig

if TYPE_CHECKING:
    import torch


def _random(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    import torch
    return torch.randn(shape, generator=gen).mul_(std)


def _layer(cfg: ModelConfig, gen: torch.Generator, p: str) -> Iterator[tuple[str, torch.Tensor]]:
    import torch
    d, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    yield p + "input_layernorm.weight", torch.ones(d)
    yield p + "self_attn.q_proj.weight", _random(gen, (q, d), 1 / math.sqrt(d))
    yield p + "self_attn.k_proj.weight", _random(gen, (kv, d), 1 / math.sqrt(d))
    yield p + "self_attn.v_proj.weight", _random(gen, (kv, d), 1 / math.sqrt(d))
    yield p + "self_attn.o_proj.weight", _random(gen, (d, q), 1 / math.sqrt(q))
    yield p + "post_attention_layernorm.weight", torch.ones(d)
    yield p + "mlp.gate_proj.weight", _random(gen, (f, d), 1 / math.sqrt(d))
    yield p + "mlp.up_proj.weight", _random(gen, (f, d), 1 / math.sqrt(d))
    yield p + "mlp.down_proj.weight", _random(gen, (d, f), 1 / math.sqrt(f))
    if cfg.attention_bias:
        for m, n in (("q", q), ("k", kv), ("v", kv)):
            yield p + f"self_attn.{m}_proj.bias", _random(gen, (n,), 0.1)


def random_weights(cfg: ModelConfig, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of `cfg`, drawn from one generator seeded with `seed`.

    Embeddings std 1 and projections std 1/sqrt(fan_in) keep activations O(1) at any depth
    and width, so bfloat16 stays finite. The final norm weight is random (not ones): with
    tied embeddings and a weak 2-layer stack the hidden state stays close to the current
    token's embedding, so ones would make greedy decoding repeat the last token forever;
    random per-channel gains break that symmetry. An untied lm_head comes last, std
    1/sqrt(hidden), so logits are O(1) too.
    """
    import torch
    gen = torch.Generator().manual_seed(seed)
    d = cfg.hidden_size
    yield "model.embed_tokens.weight", _random(gen, (cfg.vocab_size, d), 1.0)
    for i in range(cfg.num_layers):
        yield from _layer(cfg, gen, f"model.layers.{i}.")
    yield "model.norm.weight", _random(gen, (d,), 1.0)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", _random(gen, (cfg.vocab_size, d), 1 / math.sqrt(d))
