"""Float32 and bfloat16 linear layers run by the C tile kernels (splitserve/kernels/gemv.c,
and gemv_bf16.c where the CPU has AVX512-BF16).

At load time the weight W (N, K) is laid out once in the kernel's tiles (N / NR, K, NR):
NR output rows interleaved along K, NR being the kernel's two vector registers (32 floats
with AVX-512, 16 with AVX2). Decode (a few rows of x) then reads every weight once, front
to back, with no horizontal sums: faster than oneDNN's packed weights at decode's few rows
and as fast at prefill's hundreds, so one layout and one copy of each weight serve both
(docs/tuning.md has the measurement; docs/benchmarks.md, section 1, the C kernels against
PyTorch's on this machine). A bfloat16 weight is laid out the same way with K taken in
pairs, (N / 32, K / 2, 32, 2), for AVX512-BF16's pair dot product; on a CPU without it the
bfloat16 kernel reports itself unavailable and bfloat16 stays on oneDNN.

The kernel runs on the engine's one thread, sharing its tiles with the kernels' helper
thread when one runs (native_pool.py: the idle time of the front-end's CPU), so the layout
is chosen only when torch runs one thread (the engine's default on a small machine);
otherwise, or when the kernel cannot be built
(no compiler, SPLITSERVE_NATIVE_KERNELS=0), NativeLinear.create returns None and the
caller keeps oneDNN's path.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn

from splitserve.kernels.build import load
from splitserve.model import native_pool


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    lib = load("gemv")
    return None if lib is None else configure(lib)


def configure(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare gemv.c's functions on `lib` (a build of it) so ctypes converts arguments."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gemv_tile_rows.restype = ctypes.c_int
    lib.gemv_tile_rows.argtypes = []
    lib.gemv_pack.restype = None
    lib.gemv_pack.argtypes = [ptr, ptr, i64, i64]
    lib.gemv.restype = None
    lib.gemv.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64]
    lib.gemv_advise_huge.restype = ctypes.c_int
    lib.gemv_advise_huge.argtypes = [ptr, i64]
    lib.gemv_shared.restype = None
    lib.gemv_shared.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64]
    return lib


@functools.cache
def _bf16_kernel() -> ctypes.CDLL | None:
    lib = load("gemv_bf16")
    if lib is None or _kernel() is None:
        return None
    lib = configure_bf16(lib)
    return lib if lib.gemv_bf16_available() else None


def configure_bf16(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare gemv_bf16.c's functions on `lib` (a build of it); only gemv_bf16_available
    exists in a build for a CPU without AVX512-BF16."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gemv_bf16_available.restype = ctypes.c_int
    lib.gemv_bf16_available.argtypes = []
    if not lib.gemv_bf16_available():
        return lib
    lib.gemv_bf16_packed_numel.restype = i64
    lib.gemv_bf16_packed_numel.argtypes = [i64, i64]
    lib.gemv_bf16_pack.restype = None
    lib.gemv_bf16_pack.argtypes = [ptr, ptr, i64, i64]
    lib.gemv_bf16.restype = None
    lib.gemv_bf16.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64]
    lib.gemv_bf16_shared.restype = None
    lib.gemv_bf16_shared.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64]
    return lib


def _kernel_for(dtype: torch.dtype) -> ctypes.CDLL | None:
    if dtype == torch.float32:
        return _kernel()
    return _bf16_kernel() if dtype == torch.bfloat16 else None


def native_linear_supported(dtype: torch.dtype) -> bool:
    """Whether a weight of `dtype` would be run by a C kernel here, now: float32 wherever
    gemv.c builds, bfloat16 only where the CPU (and the build's target) has AVX512-BF16."""
    return torch.get_num_threads() == 1 and _kernel_for(dtype) is not None


_HUGE_PAGE = 2 << 20      # bytes
_CHUNK_BYTES = 64 << 20   # a model's weights are carved from chunks this big


class TileMemory:
    """Float32 storage for the tiles of many weights, handed out in order from 2 MB-aligned
    chunks advised as transparent huge pages (gemv_advise_huge in gemv.c says why). Weights
    taken one after another lie in the order decode reads them. Only touched pages cost
    memory: a chunk's unused tail, past its last 2 MB page in use, costs address space."""

    def __init__(self, chunk_bytes: int = _CHUNK_BYTES):
        self._chunk_numel = chunk_bytes // 4
        self._chunk, self._used = torch.empty(0), 0

    def take(self, lib: ctypes.CDLL, numel: int) -> torch.Tensor:
        """(numel,) float32, 64-byte aligned; a request bigger than a chunk gets its own.
        `lib` is a build of gemv.c."""
        padded = -(-numel // 16) * 16
        if self._used + padded > self._chunk.numel():
            self._chunk = self._new_chunk(lib, max(padded, self._chunk_numel))
            self._used = 0
        out = self._chunk[self._used:self._used + numel]
        self._used += padded
        return out

    @staticmethod
    def _new_chunk(lib: ctypes.CDLL, numel: int) -> torch.Tensor:
        raw = torch.empty(numel + _HUGE_PAGE // 4)
        start = (-raw.data_ptr()) % _HUGE_PAGE // 4
        chunk = raw[start:start + numel]
        whole_pages = numel * 4 // _HUGE_PAGE * _HUGE_PAGE   # a partial last page stays small
        if whole_pages:
            lib.gemv_advise_huge(chunk.data_ptr(), whole_pages)
        return chunk


class NativeLinear(nn.Module):
    """y = x @ W.T + b for x (..., K) -> (..., N) in the weight's dtype (float32 or
    bfloat16), W held only in the kernel's tiles."""

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor, bias: torch.Tensor | None,
                 memory: TileMemory | None = None):
        super().__init__()
        self._lib = lib
        self.dtype = dtype = torch.bfloat16 if weight.dtype == torch.bfloat16 else torch.float32
        w = weight.detach().to(dtype).contiguous()
        self.out_features, self.in_features = n, k = w.shape
        if memory is None:
            memory = TileMemory(chunk_bytes=0)   # alone: exactly its own size
        if dtype == torch.bfloat16:
            numel = lib.gemv_bf16_packed_numel(n, k)   # (N / 32, K / 2, 32, 2)
            self._tiles = memory.take(_kernel(), -(-numel // 2)).view(torch.bfloat16)[:numel]
            lib.gemv_bf16_pack(w.data_ptr(), self._tiles.data_ptr(), n, k)
            self._run, self._run_shared = lib.gemv_bf16, lib.gemv_bf16_shared
        else:
            rows, tiles = lib.gemv_tile_rows(), -(-n // lib.gemv_tile_rows())
            self._tiles = memory.take(lib, tiles * k * rows).view(tiles, k, rows)   # (N / NR, K, NR)
            lib.gemv_pack(w.data_ptr(), self._tiles.data_ptr(), n, k)
            self._run, self._run_shared = lib.gemv, lib.gemv_shared
        self._bias = None if bias is None else bias.detach().to(dtype).contiguous()
        # Addresses taken once: the per-call cost is what decode's small matrices notice.
        self._tiles_ptr = self._tiles.data_ptr()
        self._bias_ptr = None if self._bias is None else self._bias.data_ptr()

    @classmethod
    def create(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
               memory: TileMemory | None = None) -> NativeLinear | None:
        """The native layer for this weight (its tiles taken from `memory` if given), or
        None when no C kernel applies to its dtype here."""
        if not native_linear_supported(weight.dtype):
            return None
        return cls(_kernel_for(weight.dtype), weight, bias, memory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dtype == self.dtype, (x.dtype, self.dtype)
        k, n = self.in_features, self.out_features
        x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()  # (M, K)
        m = x2.shape[0]
        y = torch.empty(m, n, dtype=self.dtype)   # (M, N)
        pool = native_pool.runner()
        if pool is not None and m:
            # Tiles are handed out a few at a time for one or two rows (a tile is then a few
            # microseconds of reading memory), one at a time for more.
            self._run_shared(pool, x2.data_ptr(), self._tiles_ptr, self._bias_ptr,
                             y.data_ptr(), m, n, k, max(1, 4 // m))
        elif m:
            self._run(x2.data_ptr(), self._tiles_ptr, self._bias_ptr, y.data_ptr(), m, n, k)
        return y if x2 is x else y.reshape(*x.shape[:-1], n)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"native {str(self.dtype).removeprefix('torch.')} tiles")
