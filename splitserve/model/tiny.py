"""tiny-random: a 2-layer Llama with seeded random weights and SmolLM2's real tokenizer.

For tests and benchmarks that exercise the serving machinery, not the model: it builds in
milliseconds, runs fast on CPU, and accepts very long prompts. Its text is nonsense, but
greedy decoding is deterministic and depends on the prompt.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from splitserve.model.config import ModelConfig
from splitserve.model.gguf_loader import load_gguf_tokenizer
from splitserve.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

TINY_NAME = "tiny-random"
_SEED = 0
_ENDOFTEXT, _IM_END = 0, 2


def tiny_config(tokenizer: Tokenizer) -> ModelConfig:
    return ModelConfig(
        name=TINY_NAME, architecture="llama", vocab_size=tokenizer.vocab_size, hidden_size=64,
        intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        rms_norm_eps=1e-5, rope_theta=10000.0,
        # Large so benchmarks can send very long prompts; RoPE has no trained length here.
        max_position_embeddings=262144, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_ids=(_IM_END, _ENDOFTEXT))


@functools.lru_cache(maxsize=2)
def tiny_tokenizer(gguf_path: str) -> Tokenizer:
    return load_gguf_tokenizer(gguf_path).replace(name=TINY_NAME,
                                                   eos_token_ids=(_IM_END, _ENDOFTEXT))


def _random(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    import torch
    return torch.randn(shape, generator=gen) * std


def tiny_weights(cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The same float32 tensors on every call (one generator, seeded, fixed order).

    Embeddings std 1 and projections std 1/sqrt(fan_in) keep activations O(1). The final
    norm weight is random (not ones): with tied embeddings and a weak 2-layer stack the
    hidden state stays close to the current token's embedding, so ones would make greedy
    decoding repeat the last token forever; random per-channel gains break that symmetry.
    """
    import torch
    gen = torch.Generator().manual_seed(_SEED)
    d, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    yield "model.embed_tokens.weight", _random(gen, (cfg.vocab_size, d), 1.0)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", torch.ones(d)
        yield p + "self_attn.q_proj.weight", _random(gen, (q, d), 1 / math.sqrt(d))
        yield p + "self_attn.k_proj.weight", _random(gen, (kv, d), 1 / math.sqrt(d))
        yield p + "self_attn.v_proj.weight", _random(gen, (kv, d), 1 / math.sqrt(d))
        yield p + "self_attn.o_proj.weight", _random(gen, (d, q), 1 / math.sqrt(q))
        yield p + "post_attention_layernorm.weight", torch.ones(d)
        yield p + "mlp.gate_proj.weight", _random(gen, (f, d), 1 / math.sqrt(d))
        yield p + "mlp.up_proj.weight", _random(gen, (f, d), 1 / math.sqrt(d))
        yield p + "mlp.down_proj.weight", _random(gen, (d, f), 1 / math.sqrt(f))
    yield "model.norm.weight", _random(gen, (d,), 1.0)


def build_tiny(gguf_path: str) -> tuple[ModelConfig, Tokenizer,
                                        Callable[[], Iterator[tuple[str, torch.Tensor]]]]:
    """(config, tokenizer, weights); `gguf_path` supplies the tokenizer and chat template."""
    tokenizer = tiny_tokenizer(gguf_path)
    config = tiny_config(tokenizer)
    return config, tokenizer, lambda: tiny_weights(config)
