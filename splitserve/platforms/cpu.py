"""The CPU platform: today's engine. bfloat16 only where the CPU multiplies it natively, the
C kernels for attention (and the elementwise steps and one-thread linears, which pick
themselves by dtype), oneDNN-packed or quantized linears, the process pinned to its CPUs and
the kernels' helper thread borrowing a neighbour's idle time (model/native_pool.py)."""

from __future__ import annotations

import functools
import logging
import os

import numpy as np
import torch

from splitserve import envs
from splitserve.model import native_pool
from splitserve.model.native_linear import native_linear_supported
from splitserve.platforms.base import Platform

logger = logging.getLogger(__name__)


@functools.cache
def auto_dtype() -> torch.dtype:
    """bfloat16 where the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), else float32:
    without those, PyTorch's bfloat16 matmuls convert in software and run 3-7x slower than
    float32 (measured on AVX2), so halving the bytes does not pay. The CPU flags alone do not
    decide: ATEN_CPU_CAPABILITY=avx2 or ONEDNN_MAX_CPU_ISA=AVX2 keep PyTorch's kernels and
    oneDNN off AVX512 on an AVX512 CPU, and then bfloat16 is as slow as on AVX2."""
    bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    usable = (torch.backends.cpu.get_cpu_capability().startswith("AVX512")
              and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    dtype = torch.bfloat16 if (bf16 or amx) and usable else torch.float32
    logger.info("dtype auto -> %s (CPU capability %s, avx512_bf16 %s, amx %s)",
                str(dtype).removeprefix("torch."), torch.backends.cpu.get_cpu_capability(), bf16, amx)
    return dtype


class CpuPlatform(Platform):
    name = "cpu"
    nixl_memory = "DRAM"
    device = torch.device("cpu")

    def default_dtype(self) -> torch.dtype:
        return auto_dtype()

    def attention_backend(self) -> str:
        return envs.attention_backend() or "native"

    def prepare_model(self, model, dtype, quantization, pack):
        from splitserve.model.packed import packing_supported
        model = model.to(dtype).eval()
        if quantization is not None:
            model.quantize(quantization)
        elif pack and packing_supported(dtype):
            model.pack()
        return model

    def kv_cache_bytes(self, configured: int, gpu_memory_utilization: float | None) -> int:
        """--kv-cache-gib. A GPU memory fraction is refused, not ignored: on the CPU it would
        silently mean nothing."""
        if gpu_memory_utilization is not None:
            raise ValueError("gpu_memory_utilization applies to device cuda only; on the CPU "
                             "the KV cache is --kv-cache-gib or --num-blocks")
        return configured

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array)

    def blocks_to_host(self, blocks: list[torch.Tensor]) -> list[memoryview]:
        return [memoryview(b.numpy()) for b in blocks]    # the cache's own memory: no copy

    def host_to_block(self, frame, block: torch.Tensor) -> None:
        block.numpy()[:] = np.frombuffer(frame, dtype=np.uint8)

    def start_helpers(self, dtype: torch.dtype) -> str:
        """The C kernels' helper thread on SPLITSERVE_ENGINE_HELPER_CPU when this engine
        runs them (float32, or bfloat16 linears where the CPU has AVX512-BF16) on one torch
        thread (native_pool.py)."""
        cpu = envs.engine_helper_cpu()
        native = dtype == torch.float32 or native_linear_supported(dtype)
        if cpu is None or not native or torch.get_num_threads() != 1:
            return ""
        return f", kernels borrow CPU {cpu}'s idle time" if native_pool.start(cpu) else ""

    def quiesce(self) -> None:
        # The helper may still be running a range it lost its CPU in, reading the weights
        # and the KV cache.
        native_pool.quiesce()

    def describe(self) -> str:
        from splitserve import placement
        from splitserve.kernels import build
        return (f"{torch.get_num_threads()} torch thread(s) on CPUs "
                f"{placement.format_cpus(tuple(os.sched_getaffinity(0)))}, {build.status()}")
