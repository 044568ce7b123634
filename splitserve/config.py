"""Engine configuration: one frozen dataclass per layer, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None          # None: derived from memory_bytes
    memory_bytes: int = 1 << 30            # KV cache budget when num_blocks is None
    enable_prefix_caching: bool = True

    def __post_init__(self):
        _require(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
                 f"block_size must be a power of two, got {self.block_size}")
        _require(self.num_blocks is None or self.num_blocks >= 2,
                 f"num_blocks must be at least 2, got {self.num_blocks}")
        _require(self.memory_bytes > 0, "KV cache memory budget must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512      # token budget of one step (chunked prefill size)
    max_num_seqs: int = 64                 # running requests at most

    def __post_init__(self):
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        _require(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None               # None: the bundled SmolLM2-135M-Instruct
    dtype: str = "bfloat16"
    max_model_len: int | None = None       # None: the model's context length
    num_threads: int | None = None         # torch intra-op threads; None: leave as is
    seed: int | None = None                # seeds the sampler for requests without a seed
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self):
        _require(self.dtype in _DTYPES, f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        _require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2")
        _require(self.num_threads is None or self.num_threads >= 1, "num_threads must be >= 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]
