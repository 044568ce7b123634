"""The device seam: everything that differs between a CPU and a CUDA engine lives here.

The engine, the runner, the model and the KV transports ask `platform_for(device)` and never
test a tensor's device themselves. `resolve_device` turns the configured name (auto, cpu,
cuda) into the one a process runs on; asking for CUDA where PyTorch sees no GPU is a
ValueError with one clear line.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # torch loads where a model runs, not where configuration is read
    from splitserve.platforms.base import Platform

DEVICES = ("auto", "cpu", "cuda")   # auto: cuda when torch.cuda.is_available(), else cpu


def cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def check_device(name: str) -> None:
    """Refuses a device this machine cannot run (ValueError). Imports torch only for cuda:
    processes that only read configuration stay light."""
    if name not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "cuda" and not cuda_available():
        raise ValueError("device cuda: PyTorch sees no CUDA GPU on this machine "
                         "(use --device cpu or auto)")


def resolve_device(name: str) -> str:
    """auto|cpu|cuda -> cpu|cuda."""
    check_device(name)
    if name == "auto":
        return "cuda" if cuda_available() else "cpu"
    return name


@functools.cache
def platform_for(device: str) -> "Platform":
    """The platform of a configured device name (auto resolved here)."""
    name = resolve_device(device)
    if name == "cuda":
        from splitserve.platforms.cuda import CudaPlatform
        return CudaPlatform()
    from splitserve.platforms.cpu import CpuPlatform
    return CpuPlatform()


