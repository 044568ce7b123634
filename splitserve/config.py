"""Engine configuration: one frozen dataclass per layer, validated on construction."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from splitserve.kv import TRANSPORT_MODULES

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Names only: torch loads where a model runs (an engine process, `bench engine`), never for a
# process that only reads configuration (the orchestrator, `splitserve up`'s parent).
_DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8", "fp16")   # model/quant.py: the weight paths behind each


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
class KVTransferConfig:
    backend: str = "tcp"                   # a transport of kv/__init__.py: tcp, nixl, none
    host: str = "127.0.0.1"                # address the KV server binds and advertises
    port: int = 0                          # 0: any free port
    lease_seconds: float = 30.0            # a context_only request's KV waits this long for a pull
    timeout: float = 30.0                  # a pull that takes longer fails its request
    connect_timeout: float = 5.0           # a CTX not connected by then fails the pull (refused: at once)
    idle_seconds: float = 60.0             # a GEN's connection to a CTX unused this long is closed
    pull_threads: int = 8                  # pulls from this many CTXs run side by side
    # The cluster's internal secret: keys the KV channel's handshake (CURVE). Never logged.
    secret: str | None = field(default=None, repr=False)
    # KV endpoints (tcp://host:port) a generation_only request may name; see kv/peers.py.
    peers: tuple[str, ...] = ()

    def __post_init__(self):
        _require(self.backend in TRANSPORT_MODULES, f"KV backend must be one of "
                 f"{', '.join(TRANSPORT_MODULES)}, got {self.backend!r}")
        _require(self.lease_seconds > 0, "lease_seconds must be positive")
        _require(self.timeout > 0, "KV transfer timeout must be positive")
        _require(self.connect_timeout > 0, "KV connect_timeout must be positive")
        _require(self.idle_seconds > 0, "KV idle_seconds must be positive")
        _require(self.pull_threads >= 1, "KV pull_threads must be at least 1")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None               # None: the bundled SmolLM2-135M-Instruct
    dtype: str = "auto"                    # "auto": see auto_dtype()
    quantization: str | None = None        # "fp16" | "int8" weights; see model/quant.py
    pack_weights: bool = True              # oneDNN blocked float weights; see model/packed.py
    max_model_len: int | None = None       # None: the model's context length
    num_threads: int | None = None         # torch intra-op threads; None: leave as is
    seed: int | None = None                # seeds the sampler for requests without a seed
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv: KVTransferConfig = field(default_factory=KVTransferConfig)

    def __post_init__(self):
        _require(self.dtype == "auto" or self.dtype in _DTYPES,
                 f"dtype must be auto or one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        _require(self.quantization is None or self.quantization in QUANTIZATIONS,
                 f"quantization must be None or one of {', '.join(QUANTIZATIONS)}, "
                 f"got {self.quantization!r}")
        if self.quantization is not None:
            _require(self.dtype in ("auto", "float32"), f"quantization {self.quantization} "
                     f"computes in float32; use dtype auto or float32, not {self.dtype}")
            from splitserve.model.quant import quantization_supported
            _require(quantization_supported(self.quantization), f"quantization "
                     f"{self.quantization} needs PyTorch's FBGEMM kernels, which this torch lacks")
        _require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2")
        _require(self.num_threads is None or self.num_threads >= 1, "num_threads must be >= 1")

    @property
    def torch_dtype(self) -> "torch.dtype":
        """The dtype activations, float weights and the KV cache are held in."""
        import torch
        if self.quantization is not None:   # quantized matmuls take and return float32
            return torch.float32
        return auto_dtype() if self.dtype == "auto" else getattr(torch, self.dtype)


@functools.cache
def auto_dtype() -> "torch.dtype":
    """bfloat16 where the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), else float32:
    without those, PyTorch's bfloat16 matmuls convert in software and run 3-7x slower than
    float32 (measured on AVX2), so halving the bytes does not pay. The CPU flags alone do not
    decide: ATEN_CPU_CAPABILITY=avx2 or ONEDNN_MAX_CPU_ISA=AVX2 keep PyTorch's kernels and
    oneDNN off AVX512 on an AVX512 CPU, and then bfloat16 is as slow as on AVX2."""
    import torch
    bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    usable = (torch.backends.cpu.get_cpu_capability().startswith("AVX512")
              and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    dtype = torch.bfloat16 if (bf16 or amx) and usable else torch.float32
    logger.info("dtype auto -> %s (CPU capability %s, avx512_bf16 %s, amx %s)",
                str(dtype).removeprefix("torch."), torch.backends.cpu.get_cpu_capability(), bf16, amx)
    return dtype
