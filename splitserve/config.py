"""Engine configuration: one frozen dataclass per layer, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from splitserve.flags import flag, flags_within
from splitserve.kv import TRANSPORT_MODULES
from splitserve.platforms import DEVICES, check_device

if TYPE_CHECKING:
    import torch

# Names only: torch loads where a model runs (an engine process, `bench engine`), never for a
# process that only reads configuration (the orchestrator, `splitserve up`'s parent).
DTYPES = ("auto", "float32", "bfloat16", "float16")    # auto: the platform's default_dtype()
QUANTIZATIONS = ("int8", "fp16")   # model/quant.py: the weight paths behind each
LOAD_FORMATS = ("auto", "dummy")   # dummy: config.json only, random weights (model/dummy.py)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata=flag(
        "--block-size", "tokens per KV cache block, a power of two"))
    num_blocks: int | None = field(default=None, metadata=flag(
        "--num-blocks", "KV cache blocks (default: as many as --kv-cache-gib holds)"))
    memory_bytes: int = field(default=1 << 30, metadata=flag(
        "--kv-cache-gib", "KV cache size in GiB, when --num-blocks is not given",
        type=float, unit=1 << 30))
    enable_prefix_caching: bool = field(default=True, metadata=flag(
        "--no-prefix-caching", "never reuse the KV blocks of an earlier request's prompt"))

    def __post_init__(self):
        _require(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
                 f"block_size must be a power of two, got {self.block_size}")
        _require(self.num_blocks is None or self.num_blocks >= 2,
                 f"num_blocks must be at least 2, got {self.num_blocks}")
        _require(self.memory_bytes > 0, "KV cache memory budget must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = field(default=512, metadata=flag(
        "--max-num-batched-tokens", "tokens one engine step computes at most: the chunk a long "
                                    "prompt is prefilled in"))
    max_num_seqs: int = field(default=64, metadata=flag(
        "--max-num-seqs", "requests running at once at most"))
    max_prefill_tokens_while_decoding: int = field(default=0, metadata=flag(
        "--max-prefill-tokens-while-decoding",
        "prompt tokens a step computes at most while other requests decode, so a long "
        "prompt's chunks stall each stream's next token less; 0: max-num-batched-tokens"))

    def __post_init__(self):
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        _require(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _require(self.max_prefill_tokens_while_decoding >= 0,
                 "max_prefill_tokens_while_decoding must be 0 (no bound) or more")

    @property
    def prefill_budget_while_decoding(self) -> int:
        """Prompt tokens a step with decodes in it computes at most."""
        cap = self.max_prefill_tokens_while_decoding
        return min(cap, self.max_num_batched_tokens) if cap else self.max_num_batched_tokens


def _peers(text: str) -> tuple[str, ...]:
    """--kv-peers' argparse type, imported when used: kv/peers.py loads ZeroMQ."""
    from splitserve.kv.peers import parse_peers
    return parse_peers(text)


@dataclass(frozen=True)
class KVTransferConfig:
    backend: str = field(default="tcp", metadata=flag(
        "--kv-backend", "how KV moves from CTX to GEN workers; none moves nothing, so "
                        "generation_only output is garbage: front-end benchmarks only",
        choices=tuple(TRANSPORT_MODULES)))
    host: str = field(default="127.0.0.1", metadata=flag(
        "--kv-host", "address the KV server binds and advertises"))
    port: int = field(default=0, metadata=flag(
        "--kv-port", "port of the KV server, 0: any free one"))
    lease_seconds: float = field(default=30.0, metadata=flag(
        "--kv-lease-seconds", "seconds a context_only request's KV waits for its pull"))
    timeout: float = field(default=30.0, metadata=flag(
        "--kv-timeout", "seconds a KV pull may take before its request fails"))
    connect_timeout: float = 5.0           # a CTX not connected by then fails the pull (refused: at once)
    idle_seconds: float = 60.0             # a GEN's connection to a CTX unused this long is closed
    pull_threads: int = 8                  # pulls from this many CTXs run side by side
    # The cluster's internal secret: keys the KV channel's handshake (CURVE). Never logged.
    secret: str | None = field(default=None, repr=False)
    # KV endpoints (tcp://host:port) a generation_only request may name; see kv/peers.py.
    peers: tuple[str, ...] = field(default=(), metadata=flag(
        "--kv-peers", "comma-separated tcp://host:port KV endpoints of the context workers "
                      "this worker may pull from (default: loopback endpoints only)",
        type=_peers))

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
    model: str | None = field(default=None, metadata=flag(
        "--model", "a Hugging Face folder, a .gguf file or tiny-random (default: the bundled "
                   "SmolLM2-135M-Instruct)"))
    device: str = field(default="auto", metadata=flag(
        "--device", "where the model runs; auto: cuda when PyTorch sees a GPU, else cpu",
        choices=DEVICES))
    load_format: str = field(default="auto", metadata=flag(
        "--load-format", "auto: read --model's weights; dummy: read only its config.json (or "
                         "a shipped config: llama-3-8b, tiny-llama) and make seeded random "
                         "weights, to measure real shapes without a checkpoint",
        choices=LOAD_FORMATS))
    dtype: str = field(default="auto", metadata=flag(
        "--dtype", "auto: bfloat16 on a GPU or where the CPU computes it natively, else float32",
        choices=DTYPES))
    quantization: str | None = field(default=None, metadata=flag(
        "--quantization", "int8 (per output channel) or fp16 weights, activations in float32 "
                          "(see model/quant.py; default: none)", choices=QUANTIZATIONS))
    pack_weights: bool = field(default=True, metadata=flag(
        "--no-pack-weights", "plain row-major float weights instead of oneDNN's blocked layout "
                             "(see model/packed.py), to measure the difference"))
    max_model_len: int | None = field(default=None, metadata=flag(
        "--max-model-len", "tokens a sequence holds at most, prompt and output (default: the "
                           "model's context length); never more than the KV cache holds"))
    # None: torch's as it is; serve's and up's plans give each engine one per CPU it gets.
    num_threads: int | None = field(default=None, metadata=flag(
        "--threads", "torch threads of the engine (default: one per CPU it gets)"))
    seed: int | None = field(default=None, metadata=flag(
        "--seed", "seeds the sampler for requests without a seed of their own (default: a "
                  "random seed)"))
    # vLLM's meaning: the fraction of the GPU's memory this process may use; the KV cache gets
    # what the weights leave of it. CUDA only: on the CPU the engine refuses it.
    gpu_memory_utilization: float | None = field(default=None, metadata=flag(
        "--gpu-memory-utilization", "fraction of the GPU's memory this worker may use, the KV "
        "cache sized from what the weights leave (device cuda only; default: --kv-cache-gib)",
        metavar="FRACTION"))
    # vLLM's names. Graphs only where the platform captures them (platforms/: cuda).
    enforce_eager: bool = field(default=False, metadata=flag(
        "--enforce-eager", "run every step eagerly: no CUDA graphs for decode steps"))
    cuda_graph_max_batch: int = field(default=256, metadata=flag(
        "--cuda-graph-max-batch", "decode steps of at most this many sequences replay CUDA "
                                  "graphs (captured for 1, 2, 4, 8, 16, 24, ... sequences); "
                                  "larger ones run eagerly"))
    cache: CacheConfig = field(default_factory=CacheConfig, metadata=flags_within())
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig, metadata=flags_within())
    kv: KVTransferConfig = field(default_factory=KVTransferConfig, metadata=flags_within())

    def __post_init__(self):
        check_device(self.device)
        _require(self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
                 f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _require(self.gpu_memory_utilization is None or self.device != "cpu",
                 "gpu_memory_utilization applies to device cuda only; on the CPU the KV cache "
                 "is --kv-cache-gib or --num-blocks")
        _require(self.load_format in LOAD_FORMATS, f"load_format must be one of "
                 f"{', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        _require(self.dtype in DTYPES,
                 f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
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
        _require(self.cuda_graph_max_batch >= 1, f"cuda_graph_max_batch must be >= 1, got "
                 f"{self.cuda_graph_max_batch} (--enforce-eager turns the graphs off)")

    @property
    def platform(self):
        """The device's platform (splitserve/platforms/), auto resolved; loads torch."""
        from splitserve.platforms import platform_for
        return platform_for(self.device)

    @property
    def graph_max_batch(self) -> int:
        """Decode steps of at most this many rows replay captured graphs; 0: none do."""
        if self.enforce_eager or not self.platform.decode_graphs:
            return 0
        return self.cuda_graph_max_batch

    @property
    def torch_dtype(self) -> "torch.dtype":
        """The dtype activations, float weights and the KV cache are held in."""
        import torch
        if self.quantization is not None:   # quantized matmuls take and return float32
            return torch.float32
        return self.platform.default_dtype() if self.dtype == "auto" else getattr(torch, self.dtype)
