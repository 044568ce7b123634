"""Platform: what one kind of device decides for the engine.

A platform is stateless apart from what it caches for its device (the CUDA staging buffers);
one exists per process and device (platforms.platform_for). Every method is called from the
engine process only.
"""

from __future__ import annotations

import abc
from typing import Callable

import numpy as np
import torch


class Platform(abc.ABC):
    name: str                  # "cpu" | "cuda": what the start line names
    device: torch.device
    nixl_memory: str | None    # NIXL's memory type for the KV cache; None: nixl cannot run
    # Decode steps replay captured graphs (engine/decode_graphs.py) unless --enforce-eager:
    # only where a capture saves the launches it records.
    decode_graphs: bool = False

    @abc.abstractmethod
    def default_dtype(self) -> torch.dtype:
        """The dtype `--dtype auto` means on this device."""

    @abc.abstractmethod
    def attention_backend(self) -> str:
        """'native' (the C kernels, falling back to torch per call) or 'torch' (gather
        blocks + SDPA, model/attention.py), for every step of this engine."""

    @abc.abstractmethod
    def prepare_model(self, model: torch.nn.Module, dtype: torch.dtype,
                      quantization: str | None, pack: bool) -> torch.nn.Module:
        """A loaded CPU float32 model -> the model in `dtype` on this device, with the
        linear kernels this device runs (CPU: quantized, packed or plain; CUDA: plain)."""

    def check_config(self, quantization: str | None) -> None:
        """Refuses (ValueError) what the engine's configuration asks that this device lacks."""

    def alloc_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The KV cache: one contiguous tensor on this device, zeroed."""
        return torch.zeros(shape, dtype=dtype, device=self.device)

    @abc.abstractmethod
    def kv_cache_bytes(self, configured: int, gpu_memory_utilization: float | None) -> int:
        """The bytes the KV cache may take, asked once the weights are loaded."""

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array -> a tensor on this device (shares the array's memory on the CPU)."""
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor the engine refills and copies to the device step after step."""
        return torch.empty(numel, dtype=dtype)

    def capture_graph(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """fn, which reads and writes only tensors at fixed addresses that outlive it, -> a
        replay computing what fn computes on those tensors' current contents. Here the
        replay is fn itself, called again (the CPU, where there are no launches to save);
        CUDA records fn's kernels once and replays them."""
        return fn

    def generator(self, seed: int) -> torch.Generator:
        """A random generator on this device, seeded."""
        return torch.Generator(self.device).manual_seed(seed)

    # -- KV transfer --------------------------------------------------------------------
    @abc.abstractmethod
    def blocks_to_host(self, blocks: list[torch.Tensor]) -> list[memoryview]:
        """KV blocks' bytes (each one contiguous uint8 tensor) readable by a socket, one
        buffer per block; each stays valid while the caller holds it."""

    @abc.abstractmethod
    def host_to_block(self, frame, block: torch.Tensor) -> None:
        """Writes one block's bytes (a buffer of exactly block.numel() bytes) into it."""

    def finish_transfers(self) -> None:
        """Returns when every host_to_block's copy has landed."""

    # -- the process --------------------------------------------------------------------
    def place_process(self) -> None:
        """Pins the process to its CPUs (SPLITSERVE_ENGINE_CPUS) before torch starts its
        OpenMP threads (at the first parallel region), so that they inherit them."""
        from splitserve import envs, placement
        cpus = envs.engine_cpus()
        if cpus:
            placement.pin_process(placement.parse_cpus(cpus), "engine")

    def start_helpers(self, dtype: torch.dtype) -> str:
        """Starts the helper threads this device's kernels use; what the start line says."""
        return ""

    def quiesce(self) -> None:
        """Waits until no helper thread reads the weights or the KV cache (they are about
        to be freed)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """The start line's words for the device, e.g. '1 torch thread(s) on CPUs 0-1'."""
