"""Prefill attention through the C kernel (splitserve/kernels/attention.c).

The kernel reads keys and values in place from the paged cache through the block table, so
a prefill chunk needs neither a gather nor an (L, S) mask. On one thread it runs 1.5-1.7x
faster than PyTorch's flash SDPA at 2k tokens (SmolLM2's 9 query / 3 KV heads of 64; see
docs/benchmarks.md). It is single-threaded, so the engine uses it only when it runs one
torch thread (its default on small machines, see splitserve/placement.py), in float32.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from splitserve.kernels import build

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@functools.cache
def _kernel():
    lib = build.load("attention")
    return None if lib is None else bind(lib)


def bind(lib: ctypes.CDLL):
    """The kernel's entry point in `lib`, typed for ctypes."""
    fn = lib.attn_prefill_f32
    fn.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _INT, _INT, _I64,
                   _INT, _INT, _INT, _INT, ctypes.c_float]
    fn.restype = _INT
    return fn


def usable(q: torch.Tensor) -> bool:
    """Whether prefill chunks of these queries go through the kernel."""
    return q.dtype == torch.float32 and torch.get_num_threads() == 1 and _kernel() is not None


def prefill(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, table: torch.Tensor,
            start: int, window: int | None, scale: float) -> torch.Tensor | None:
    """q (L, H, D), a view with unit stride inside a token, of the queries at positions
    start .. start+L-1; their keys and values already in `kv_cache` (num_blocks, num_layers,
    2, block_size, KVH, D) at the blocks of `table` (1, n) -> (L, H, D), or None for a shape
    the kernel does not take (the caller runs SDPA)."""
    length, heads, dim = q.shape
    kvh = kv_cache.shape[-2]
    if q.stride(2) != 1 or q.stride(1) != dim or not kv_cache.is_contiguous():
        return None
    table = table.reshape(-1)
    assert table.dtype == torch.int64 and table.is_contiguous()
    out = torch.empty(length, heads, dim, dtype=q.dtype)
    layer_kv = kv_cache[:, layer]
    rc = _kernel()(q.data_ptr(), q.stride(0), out.data_ptr(), heads * dim, layer_kv.data_ptr(),
                   kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3), table.data_ptr(),
                   kv_cache.shape[3], length, start, heads, kvh, dim, window or 0, scale)
    return out if rc == 0 else None
