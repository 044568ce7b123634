"""Weight-only int8 for CPU: per-output-channel symmetric int8 weights, float32 activations.

The matmul is FBGEMM's dynamic-quantization linear (torch.ops.quantized.linear_dynamic):
each call quantizes its input to uint8 with one scale for the whole (T, K) input, multiplies
in integers and returns float32. On a CPU without native bfloat16 this is the fastest
matmul PyTorch offers (2-10x float32 on AVX2) and it reads a quarter of float32's bytes.

Numerics to know about: activations are quantized per call, not per row, so a row's output
depends (slightly) on the other rows of the step; greedy output is not batch-invariant the
way float32 is. reduce_range keeps activations to 7 bits so that AVX2's 16-bit
multiply-add (vpmaddubsw) never saturates.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

QUANTIZATIONS = ("int8",)

# PyTorch 2.13 deprecates creating qint8 tensors; FBGEMM's prepack still takes one. We make
# exactly one per weight, at load time, so the warning says nothing a user can act on.
_QTENSOR_WARNING = r"torch\.quantize_per_tensor, torch\.quantize_per_channel"


def int8_supported() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.quantized, "linear_dynamic")


class Int8Linear(nn.Module):
    """y = x @ dequant(W_int8).T + b for float32 x (..., K) -> (..., N)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        w = weight.detach().float()                                   # (N, K)
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)          # (N,) per output channel
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_QTENSOR_WARNING, category=UserWarning)
            qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
            b = None if bias is None else bias.detach().float()
            self._packed = torch.ops.quantized.linear_prepack(qw, b)
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self._packed, True)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_linears(module: nn.Module) -> int:
    """Replace every nn.Linear under `module` with an Int8Linear; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child.weight, child.bias))
            count += 1
        else:
            count += quantize_linears(child)
    return count
