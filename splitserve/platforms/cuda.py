"""The CUDA platform: weights, KV cache and sampling on the GPU; plain torch linears and the
torch attention backend (gather blocks + SDPA); bfloat16 by default; the KV cache sized from
--gpu-memory-utilization; KV blocks staged through pinned host memory for the tcp transport.

The host process is still pinned to its CPUs (its Python and the copies' launches run there);
the CPU kernels' helper thread has nothing to do here and never starts.
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np
import torch

from splitserve.platforms.base import Platform

STAGING_SLOTS = 8     # pinned buffers a receiving thread cycles through: copies in flight


class CudaPlatform(Platform):
    name = "cuda"
    nixl_memory = None   # VRAM registration waits for a GPU with NIXL's CUDA plugin
    decode_graphs = True

    def __init__(self, index: int | None = None):
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        self._local = threading.local()     # each transport thread's staging ring
        self._graph_pool = None             # one memory pool for every captured graph

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def attention_backend(self) -> str:
        return "torch"

    def check_config(self, quantization: str | None) -> None:
        if quantization is not None:
            raise ValueError(f"quantization {quantization} runs on the CPU only "
                             "(model/quant.py); leave it out with --device cuda")

    def prepare_model(self, model, dtype, quantization, pack):
        self.check_config(quantization)
        return model.to(device=self.device, dtype=dtype).eval()

    def kv_cache_bytes(self, configured: int, gpu_memory_utilization: float | None) -> int:
        """vLLM's meaning: this process may use `gpu_memory_utilization` of the GPU's whole
        memory; the KV cache gets what is left of it after the weights (already loaded) and
        a reserve for activations. Without it, the configured budget."""
        if gpu_memory_utilization is None:
            return configured
        free, total = torch.cuda.mem_get_info(self.device)
        used_here = torch.cuda.memory_reserved(self.device)
        budget = int(total * gpu_memory_utilization) - used_here - _activation_reserve(total)
        budget = min(budget, free)
        if budget <= 0:
            raise ValueError(f"gpu_memory_utilization {gpu_memory_utilization} leaves no room "
                             f"for a KV cache: the weights take {used_here / 2**30:.1f} GiB of "
                             f"{total / 2**30:.1f} GiB")
        return budget

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Pinned: its copy to the GPU is one DMA, queued without waiting."""
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def capture_graph(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """A CUDA graph of fn's kernels. fn runs once first, on a side stream as PyTorch
        asks, so that lazy set-ups (cuBLAS workspaces, SDPA's kernel choice) happen outside
        the capture. Graphs share one memory pool: they never run at once, and each one's
        output stays allocated (held here), so no later capture reuses it. The capture
        forbids unsafe calls (allocating pinned memory, synchronizing) in this thread only:
        the KV transfer threads go on staging blocks meanwhile."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        return replay

    def blocks_to_host(self, blocks: list[torch.Tensor]) -> list[memoryview]:
        """All the offered blocks copied into one pinned buffer (torch's caching host
        allocator keeps it for the next offer), one wait for them all."""
        if not blocks:
            return []
        host = torch.empty(len(blocks), blocks[0].numel(), dtype=torch.uint8, pin_memory=True)
        for row, block in zip(host, blocks):
            row.copy_(block, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return [memoryview(row) for row in host.numpy()]

    def host_to_block(self, frame, block: torch.Tensor) -> None:
        """Copies the frame into the next pinned slot, then launches its copy to the GPU
        without waiting: the socket's next frame is read while it runs."""
        ring = self._ring(block.numel())
        slot, event = ring.pop(0)
        event.synchronize()                     # the slot's previous copy has landed
        slot.numpy()[:] = np.frombuffer(frame, dtype=np.uint8)
        block.copy_(slot, non_blocking=True)
        event.record(torch.cuda.current_stream(self.device))
        ring.append((slot, event))

    def finish_transfers(self) -> None:
        for _, event in getattr(self._local, "ring", ()):
            event.synchronize()

    def _ring(self, nbytes: int) -> list:
        ring = getattr(self._local, "ring", None)
        if ring is None or ring[0][0].numel() != nbytes:
            ring = self._local.ring = [
                (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), torch.cuda.Event())
                for _ in range(STAGING_SLOTS)]
        return ring

    def describe(self) -> str:
        props = torch.cuda.get_device_properties(self.device)
        return (f"{self.device} ({props.name}, {props.total_memory / 2**30:.0f} GiB), "
                f"{torch.get_num_threads()} torch thread(s) on the host")


def _activation_reserve(total: int) -> int:
    """Kept free for a step's activations and the allocator's slack: 5% of the GPU, at most
    4 GiB."""
    return min(total // 20, 4 << 30)
