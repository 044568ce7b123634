"""What a benchmark result records about where it ran: package versions and the machine."""

from __future__ import annotations

import os
import platform
from importlib import metadata

import splitserve


def versions() -> dict:
    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None
    return {"splitserve": splitserve.__version__, "python": platform.python_version(),
            **{p: version(p) for p in ("torch", "aiohttp", "httptools", "numpy")}}


def machine() -> dict:
    def lines(path: str) -> list[str]:
        try:
            with open(path) as f:
                return f.read().splitlines()
        except OSError:
            return []
    cpu = [ln.split(":", 1)[1].strip() for ln in lines("/proc/cpuinfo")
           if ln.startswith("model name")]
    mem = [int(ln.split()[1]) * 1024 for ln in lines("/proc/meminfo") if ln.startswith("MemTotal:")]
    return {"nproc": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
            "memory_bytes": mem[0] if mem else None,
            "cpu_model": cpu[0] if cpu else platform.processor() or None,
            "platform": platform.platform()}
