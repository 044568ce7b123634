"""Linear layers with weights reordered once, at load time, into oneDNN's blocked layout.

A plain nn.Linear hands oneDNN a row-major (N, K) weight on every call, and for the small
row counts of decode oneDNN streams that layout from memory at a fraction of the bandwidth
it reaches on its own blocked layout. Reordering once (torch.ops.mkldnn._reorder_linear_weight,
what torch.compile's CPU freezing pass does) and calling the matmul on the packed weight
makes decode matmuls faster, for float32 and bfloat16 alike (docs/tuning.md). The result equals F.linear up to
float32 accumulation order.

The packed weight is opaque: it cannot be read back as a tensor, so packing happens after
the weights are loaded and any (tied) weight still needed elsewhere is kept as it is.

Float32 weights on one torch thread go to the C kernel's own layout instead
(splitserve/model/native_linear.py), faster still for decode; packed_linear chooses.
Bfloat16 weights on one thread of a CPU with AVX512-BF16 keep both: the C kernel is faster
for a step of one or two rows, where the weights' bytes set the pace, and oneDNN (AMX where
the CPU has it) from a few rows on, where the multiplies do (docs/tuning.md, the crossover).
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.model.linear import replace_linears
from splitserve.model.native_linear import NativeLinear, TileMemory

# oneDNN picks its blocking for an expected row count; decode batches are this small.
_BATCH_HINT = 8
# Rows up to which the bfloat16 C kernel runs rather than oneDNN (docs/tuning.md).
NATIVE_BF16_MAX_ROWS = 2


def packing_supported(dtype: torch.dtype) -> bool:
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


class PackedLinear(nn.Module):
    """y = x @ W.T + b for x (T, K) in the weight's dtype -> (T, N)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        w = weight.detach().contiguous()
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w, _BATCH_HINT)
        self._bias = None if bias is None else bias.detach().contiguous()
        self.out_features, self.in_features = w.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self._bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


class RowSplitLinear(nn.Module):
    """y = x @ W.T + b by `few` (a NativeLinear) for inputs of up to `max_rows` rows and by
    `many` (a PackedLinear) beyond: two copies of W, one per layout, each run where it is
    the faster."""

    def __init__(self, few: NativeLinear, many: PackedLinear, max_rows: int):
        super().__init__()
        self.few, self.many, self.max_rows = few, many, max_rows
        self.out_features, self.in_features = few.out_features, few.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        return self.few(x) if rows <= self.max_rows else self.many(x)


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
                  memory: TileMemory | None = None) -> nn.Module:
    """The C kernel's layer where it applies (float32 or, with AVX512-BF16, bfloat16 on one
    thread), else a PackedLinear. A float32 layer holds the one copy of the weight, in its
    own layout; a bfloat16 one also a PackedLinear for many rows (RowSplitLinear)."""
    native = NativeLinear.create(weight, bias, memory)
    if native is None:
        return PackedLinear(weight, bias)
    if native.dtype == torch.bfloat16 and packing_supported(torch.bfloat16):
        return RowSplitLinear(native, PackedLinear(weight, bias), NATIVE_BF16_MAX_ROWS)
    return native


def pack_linears(module: nn.Module) -> int:
    """Replace every nn.Linear under `module` by its packed_linear; returns how many. The
    native ones share a TileMemory: their weights lie in the order the layers run."""
    memory = TileMemory()
    return replace_linears(module, lambda weight, bias: packed_linear(weight, bias, memory))
