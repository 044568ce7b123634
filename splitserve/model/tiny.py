"""tiny-random: a 2-layer Llama with seeded random weights and SmolLM2's real tokenizer.

For tests and benchmarks that exercise the serving machinery, not the model: it builds in
milliseconds, runs fast on CPU, and accepts very long prompts. Its text is nonsense, but
greedy decoding is deterministic and depends on the prompt.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from splitserve.model.config import ModelConfig
from splitserve.model.gguf_loader import load_gguf_tokenizer
from splitserve.model.random_weights import random_weights
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


def build_tiny(gguf_path: str) -> tuple[ModelConfig, Tokenizer,
                                        Callable[[], Iterator[tuple[str, torch.Tensor]]]]:
    """(config, tokenizer, weights); `gguf_path` supplies the tokenizer and chat template."""
    tokenizer = tiny_tokenizer(gguf_path)
    config = tiny_config(tokenizer)
    return config, tokenizer, lambda: random_weights(config, _SEED)
