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
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.model.linear import replace_linears
from splitserve.model.native_linear import NativeLinear, TileMemory

# oneDNN picks its blocking for an expected row count; decode batches are this small.
_BATCH_HINT = 8


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


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
                  memory: TileMemory | None = None) -> nn.Module:
    """The C kernel's layer where it applies (float32, one thread), else a PackedLinear.
    Either holds the one copy of the weight, in its own layout."""
    native = NativeLinear.create(weight, bias, memory)
    return native if native is not None else PackedLinear(weight, bias)


def pack_linears(module: nn.Module) -> int:
    """Replace every nn.Linear under `module` by its packed_linear; returns how many. The
    native ones share a TileMemory: their weights lie in the order the layers run."""
    memory = TileMemory()
    return replace_linears(module, lambda weight, bias: packed_linear(weight, bias, memory))
