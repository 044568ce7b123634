"""The planner's settings; its flags are made from them (flags.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.flags import flag


@dataclass(frozen=True)
class PlannerConfig:
    orchestrator: str = field(default="http://127.0.0.1:8000", metadata=flag(
        "--orchestrator", "the orchestrator whose pools the planner moves workers between"))
    ttft_p90_ms: float | None = field(default=None, metadata=flag(
        "--ttft-p90-ms", "SLO: the context pool's time to first token, 90th percentile "
        "(None: no TTFT SLO)"))
    itl_p90_ms: float | None = field(default=None, metadata=flag(
        "--itl-p90-ms", "SLO: the generation pool's inter-token latency, 90th percentile "
        "(None: no ITL SLO)"))
    interval: float = field(default=2.0, metadata=flag(
        "--interval", "seconds between two looks at the workers' metrics"))
    window: float = field(default=30.0, metadata=flag(
        "--window", "seconds of metrics a decision reads"))
    cooldown: float = field(default=30.0, metadata=flag(
        "--cooldown", "seconds after a move before the next one; the window starts afresh"))
    headroom: float = field(default=0.7, metadata=flag(
        "--headroom", "a worker leaves a pool only while that pool's p90 is below this "
        "fraction of its SLO"))
    min_samples: int = field(default=20, metadata=flag(
        "--min-samples", "observations a window needs before its p90 counts"))
    min_ctx: int = field(default=1, metadata=flag(
        "--min-ctx", "context workers the planner always leaves"))
    min_gen: int = field(default=1, metadata=flag(
        "--min-gen", "generation workers the planner always leaves"))
    max_workers: int | None = field(default=None, metadata=flag(
        "--max-workers", "where the planner may start workers (`up --planner`): the most the "
        "pools hold together (None: it only moves workers)"))
    scale_down_below: float = field(default=0.3, metadata=flag(
        "--scale-down-below", "where it may stop workers: it retires one while both pools "
        "are below this fraction of their SLOs"))
    host: str = field(default="127.0.0.1", metadata=flag(
        "--host", "where the planner serves /metrics and /health"))
    port: int = field(default=0, metadata=flag("--port", "0: any free port (logged)"))

    def __post_init__(self):
        for name in ("ttft_p90_ms", "itl_p90_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if self.ttft_p90_ms is None and self.itl_p90_ms is None:
            raise ValueError("give an SLO: --ttft-p90-ms and/or --itl-p90-ms")
        if not (self.interval > 0 and self.window >= self.interval and self.cooldown >= 0):
            raise ValueError("--interval must be positive, --window at least --interval, "
                             "--cooldown at least 0")
        if not 0 < self.headroom <= 1:
            raise ValueError(f"--headroom must be in (0, 1], got {self.headroom}")
        if self.min_samples < 1 or self.min_ctx < 1 or self.min_gen < 1:
            raise ValueError("--min-samples, --min-ctx and --min-gen must be at least 1")
        if self.max_workers is not None and self.max_workers < self.min_ctx + self.min_gen:
            raise ValueError(f"--max-workers must be at least --min-ctx + --min-gen "
                             f"({self.min_ctx + self.min_gen}), got {self.max_workers}")
        if not 0 < self.scale_down_below < 1:
            raise ValueError(f"--scale-down-below must be in (0, 1), got {self.scale_down_below}")
