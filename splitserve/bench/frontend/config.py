"""What `splitserve bench frontend` runs: the grid of token relay modes, prompt lengths and
concurrencies, and the bounds of every run (main.py)."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.config import CacheConfig
from splitserve.protocol.disagg import TOKEN_RELAYS as MODES
MODES_LIGHT_FIRST = ("metadata", "b64", "list")    # the order a cell's runs go in
DEFAULT_ISL = (1024, 8192, 32768, 131072)
DEFAULT_CONCURRENCY = (64, 256, 1024)
QUICK_ISL, QUICK_CONCURRENCY = (1024, 32768), (64, 256)


class BenchError(RuntimeError):
    pass


@dataclass(frozen=True)
class FrontendBenchConfig:
    modes: tuple[str, ...] = MODES
    isl: tuple[int, ...] = DEFAULT_ISL
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    requests: int | None = None        # per run; None: max(4 * concurrency, 1000)
    duration: float = 20.0             # seconds per run at most; requests in flight finish
    min_duration: float = 2.0          # seconds per run at least (more requests if need be)
    url: str | None = None             # an existing worker; None: start one
    max_tokens: int = 1                # per request; > 1 holds requests decoding on the worker
    ramp_up: float = 0.0               # seconds over which a run's first requests go out
    think_time: float = 0.0            # mean seconds a connection waits after each answer
    block_size: int = CacheConfig.block_size
    kv_cache_gib: float = 2.0          # the started worker's KV pool (serve's is 1 GiB)
    timeout: float = 120.0             # seconds per request
    progress: bool = True
    frontends: tuple[int, ...] = (1,)  # front-end processes of the started worker, in turn

    def __post_init__(self):
        bad = [m for m in self.modes if m not in MODES]
        _require(self.modes and not bad, f"--modes takes {', '.join(MODES)}; got {bad or 'none'}")
        _require(self.isl and min(self.isl) >= 1, "--isl values must be >= 1")
        _require(self.concurrency and min(self.concurrency) >= 1, "--concurrency values must be >= 1")
        _require(self.frontends and min(self.frontends) >= 1,
                 "--api-server-counts values must be >= 1")
        _require(self.url is None or self.frontends == (1,),
                 "--api-server-counts needs a worker started here (no --url)")
        _require(self.requests is None or self.requests >= 1, "--requests must be >= 1")
        _require(self.max_tokens >= 1, "--max-tokens must be >= 1")
        _require(self.ramp_up >= 0, "--ramp-up must be >= 0")
        _require(self.think_time >= 0, "--think-time must be >= 0")
        _require(self.duration > 0 and self.timeout > 0, "--duration and --timeout must be > 0")
        _require(0 <= self.min_duration <= self.duration,
                 "--min-duration must be >= 0 and at most --duration")

    def num_requests(self, concurrency: int) -> int:
        return self.requests or max(4 * concurrency, 1000)


def _require(ok, message: str) -> None:
    if not ok:
        raise ValueError(message)
