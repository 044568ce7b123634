"""ModelConfig: the architecture of a Llama-family decoder, whatever file it came from."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.errors import ModelLoadError

ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1-style frequency scaling ("rope_type": "llama3"); None means plain RoPE."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    name: str
    architecture: str            # one of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False          # q/k/v projections carry a bias (Qwen2)
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None     # Mistral v0.1; None: full attention
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ModelLoadError(f"unsupported architecture {self.architecture!r}; "
                                 f"supported: {', '.join(ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_heads ({self.num_heads}) must be a multiple of "
                                 f"num_kv_heads ({self.num_kv_heads})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"model config {name} must be positive")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.kv_size * dtype_bytes
