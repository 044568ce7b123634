"""The decoder layer's elementwise steps: one C call each in float32
(splitserve/kernels/elementwise.c) on the CPU, PyTorch otherwise (bfloat16, a GPU, or no C
compiler).

At decode sizes each PyTorch kernel costs several microseconds of dispatch for a few
hundred floats of work; the residual add + RMSNorm, the three-kernel RoPE and SiLU-mul are
~26 us per layer on one core (SmolLM2, batch 1) that one call each does in a few.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from splitserve.kernels import build

_I64, _PTR, _INT, _F = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


@functools.cache
def _lib():
    lib = build.load("elementwise")
    if lib is not None:
        lib.add_rms_norm.argtypes = [_PTR, _PTR, _PTR, _PTR, _INT, _INT, _F]
        lib.rope.argtypes = [_PTR, _I64, _INT, _INT, _INT, _PTR, _PTR]
        lib.silu_mul.argtypes = [_PTR, _PTR, _INT, _INT]
        for fn in (lib.add_rms_norm, lib.rope, lib.silu_mul):
            fn.restype = None
    return lib


def _native(x: torch.Tensor) -> bool:
    # The kernels take host pointers: a GPU's tensors always take the PyTorch path.
    return x.dtype == torch.float32 and x.device.type == "cpu" and _lib() is not None


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, norm) -> torch.Tensor:
    """x += delta (in place; x must be the caller's own tensor), then norm(x). x, delta
    (T, N) contiguous; norm an RMSNorm."""
    if not _native(x) or not x.is_contiguous():
        if delta is not None:
            x.add_(delta)
        return norm(x)
    delta = None if delta is None else delta.contiguous()
    out = torch.empty_like(x)
    _lib().add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(),
                        norm.weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], norm.eps)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place: x = x * cos + rotate_half(x) * sin for x (T, N, D), heads contiguous within
    a token; cos (T, 1, D) and sin (T, 1, D) with its first half negated."""
    t, n, d = x.shape
    if not _native(x) or x.stride(2) != 1 or x.stride(1) != d or not (
            cos.is_contiguous() and sin.is_contiguous()):
        swapped = x.view(t, n, 2, d // 2).flip(2).view(t, n, d)
        x.mul_(cos).addcmul_(swapped, sin)
        return
    _lib().rope(x.data_ptr(), x.stride(0), t, n, d, cos.data_ptr(), sin.data_ptr())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I) gate | up -> (T, I) silu(gate) * up."""
    if not _native(gate_up) or not gate_up.is_contiguous():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, i, dtype=gate_up.dtype)
    _lib().silu_mul(gate_up.data_ptr(), out.data_ptr(), t, i)
    return out
