"""Attention through the C kernels: prefill chunks (splitserve/kernels/attention.c) and the
decode batch (attention_decode.c).

The kernels read keys and values in place from the paged cache through the block tables,
so nothing is gathered and no mask tensor is built. Prefill runs faster than PyTorch's flash
SDPA on one core (docs/tuning.md; docs/benchmarks.md, section 1, the C kernels against
PyTorch's on this machine). Decode reads each sequence's KV once, where gather + SDPA moves
it three times. The kernels are single-threaded: an engine with several
torch threads splits a prefill chunk's queries into that many row ranges of equal causal
work, and a decode batch into groups of sequences, and runs them on a thread pool (ctypes
releases the GIL for the call).
"""

from __future__ import annotations

import ctypes
import functools
from concurrent.futures import ThreadPoolExecutor

import torch

from splitserve.kernels import build
from splitserve.model import native_pool

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_ROWS = 16                  # split chunks at multiples of the kernel's widest vector


@functools.cache
def _kernel():
    lib = build.load("attention")
    return None if lib is None else bind(lib)


@functools.cache
def _decode_kernel():
    lib = build.load("attention_decode")
    return None if lib is None else bind_decode(lib)


_PREFILL_ARGS = [_PTR, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _INT, _INT, _I64,
                 _INT, _INT, _INT, _INT, ctypes.c_float]
_DECODE_ARGS = [_PTR, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _INT,
                _INT, _INT, _INT, _INT, _INT, ctypes.c_float]


def bind(lib: ctypes.CDLL):
    """The prefill kernel's entry point in `lib`, typed for ctypes. Its first argument is
    the helper's pool (native_pool.runner()), or None to run on the calling thread alone."""
    fn = lib.attn_prefill_shared
    fn.argtypes, fn.restype = _PREFILL_ARGS, _INT
    return fn


def bind_decode(lib: ctypes.CDLL):
    """The decode kernel's entry point in `lib`, typed for ctypes; its first argument as
    bind's."""
    fn = lib.attn_decode_shared
    fn.argtypes, fn.restype = _DECODE_ARGS, _INT
    return fn


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="attention")


def usable(q: torch.Tensor) -> bool:
    """Whether prefill chunks of these queries go through the kernel."""
    return q.dtype == torch.float32 and _kernel() is not None


def decode_usable(q: torch.Tensor) -> bool:
    """Whether decode queries like these go through the decode kernel."""
    return q.dtype == torch.float32 and _decode_kernel() is not None


def decode(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, tables: torch.Tensor,
           positions: torch.Tensor, window: int | None, scale: float) -> torch.Tensor | None:
    """q (B, H, D), one query per sequence at positions (B,) int64, the sequences' blocks in
    the rows of tables (B, n) int64 -> (B, H, D), or None for a shape the kernel does not
    take (the caller gathers and runs SDPA)."""
    batch, heads, dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != dim or not kv_cache.is_contiguous():
        return None
    assert tables.is_contiguous() and positions.is_contiguous()
    out = torch.empty(batch, heads, dim, dtype=q.dtype)
    pool = _helper()
    parts = max(1, min(torch.get_num_threads(), batch))
    bounds = [batch * k // parts for k in range(parts + 1)]

    def run(a: int, b: int) -> int:
        return _decode_kernel()(
            pool, q[a].data_ptr(), q.stride(0), out[a].data_ptr(), heads * dim,
            kv_cache[:, layer].data_ptr(), kv_cache.stride(0), kv_cache.stride(2),
            kv_cache.stride(3), tables[a].data_ptr(), tables.stride(0), positions[a].data_ptr(),
            b - a, kv_cache.shape[3], heads, kv_cache.shape[-2], dim, window or 0, scale)

    return out if _all_ran(run, list(zip(bounds, bounds[1:]))) else None


def prefill(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, table: torch.Tensor,
            start: int, window: int | None, scale: float) -> torch.Tensor | None:
    """q (L, H, D), a view with unit stride inside a token, of the queries at positions
    start .. start+L-1; their keys and values already in `kv_cache` (num_blocks, num_layers,
    2, block_size, KVH, D) at the blocks of `table` (1, n) -> (L, H, D), or None for a shape
    the kernel does not take (the caller runs SDPA)."""
    length, heads, dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != dim or not kv_cache.is_contiguous():
        return None
    table = table.reshape(-1)
    assert table.dtype == torch.int64 and table.is_contiguous()
    out = torch.empty(length, heads, dim, dtype=q.dtype)
    pool = _helper()
    ranges = _split(length, start, torch.get_num_threads())

    def run(a: int, b: int) -> int:
        return _kernel()(pool, q[a].data_ptr(), q.stride(0), out[a].data_ptr(), heads * dim,
                         kv_cache[:, layer].data_ptr(), kv_cache.stride(0), kv_cache.stride(2),
                         kv_cache.stride(3), table.data_ptr(), kv_cache.shape[3], b - a,
                         start + a, heads, kv_cache.shape[-2], dim, window or 0, scale)

    return out if _all_ran(run, ranges) else None


def _helper() -> int | None:
    """The kernels' helper (native_pool.py) on one torch thread; with more, the row ranges
    go to this module's thread pool instead."""
    return native_pool.runner() if torch.get_num_threads() == 1 else None


def _all_ran(run, ranges: list[tuple[int, int]]) -> bool:
    """run(a, b) for every range, the first on this thread and the rest on the pool; whether
    each returned 0 (the kernel took the shape)."""
    rest = [_pool(len(ranges) - 1).submit(run, a, b) for a, b in ranges[1:]]
    return not any([run(*ranges[0])] + [f.result() for f in rest])


def _split(length: int, start: int, parts: int) -> list[tuple[int, int]]:
    """Row ranges of about equal work (row i attends start + i + 1 keys), each a multiple of
    _ROWS long but the last."""
    parts = max(1, min(parts, length // _ROWS))
    if parts == 1:
        return [(0, length)]
    total = length * start + length * (length + 1) / 2
    bounds = [0]
    for k in range(1, parts):
        # rows r with r * start + r * r / 2 = k / parts of the work
        r = int((-start + (start * start + 2 * total * k / parts) ** 0.5) / _ROWS) * _ROWS
        if bounds[-1] < r < length:
            bounds.append(r)
    bounds.append(length)
    return list(zip(bounds, bounds[1:]))
