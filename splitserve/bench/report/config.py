"""What `splitserve bench report` writes where, and for which model and dtype."""

from __future__ import annotations

import os
from dataclasses import dataclass

from splitserve.bench.report.machine import machine


@dataclass(frozen=True)
class ReportConfig:
    quick: bool = False
    model: str | None = None            # passed to every step; None: the bundled model
    dtype: str | None = None            # of served workers; None: float32 unless bf16 is native
    out: str = "docs/benchmarks.md"
    img_dir: str = "docs/img"
    results_dir: str = "bench-results"
    frontend_args: tuple[str, ...] = ()
    start_timeout: float = 300.0        # seconds for a server to answer /health
    vllm_venv: str | None = None        # a virtualenv for CPU vLLM (reference.py); None: skip
    command: str = "splitserve bench report"

    def __post_init__(self):
        if self.dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
        if not self.start_timeout > 0:
            raise ValueError(f"--start-timeout must be positive, got {self.start_timeout}")

    @property
    def serve_dtype(self) -> str:
        return self.dtype or ("bfloat16" if machine()["native_bf16"] else "float32")

    @property
    def model_args(self) -> list[str]:
        return ["--model", self.model] if self.model else []

    def result(self, name: str) -> str:
        return os.path.join(self.results_dir, name)

    def img(self, name: str) -> str:
        return os.path.join(self.img_dir, name)

    def link(self, path: str) -> str:
        """`path` as the page links it: relative to the page's folder."""
        return os.path.relpath(path, os.path.dirname(os.path.abspath(self.out)))
