"""Quantized linear layers for CPU, on PyTorch's FBGEMM kernels. Activations enter and
leave as float32; both kinds read fewer weight bytes than float32 and, on a CPU without
native bfloat16, run faster than any float matmul PyTorch has.

- "fp16": weights in float16, multiplied in float32 (torch.ops.quantized.linear_dynamic_fp16).
  Activations are not quantized; logits match float32 to ~1e-3 relative.
- "int8": per-output-channel symmetric int8 weights (torch.ops.quantized.linear_dynamic).
  FBGEMM quantizes each call's input to 7-bit unsigned with one scale for the whole (T, K)
  input, so activation outliers cost precision: fastest, but lossy on small models, and a
  row's output depends slightly on the other rows of its step (not batch-invariant).
  7 bits (reduce_range) because AVX2's 16-bit multiply-add (vpmaddubsw) saturates with 8.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from splitserve.config import QUANTIZATIONS
from splitserve.model.linear import replace_linears


# PyTorch 2.13 deprecates creating qint8 tensors; FBGEMM's int8 prepack still takes one. We
# make one per weight at load time, so the warning says nothing a user can act on.
_QTENSOR_WARNING = r"torch\.quantize_per_tensor, torch\.quantize_per_channel"


def quantization_supported(method: str) -> bool:
    op = {"int8": "linear_dynamic", "fp16": "linear_dynamic_fp16"}[method]
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized, op)


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
            self._packed = torch.ops.quantized.linear_prepack(qw, _float(bias))
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self._packed, True)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Fp16Linear(nn.Module):
    """y = x @ W_fp16.T + b for float32 x (..., K) -> (..., N), accumulated in float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self._packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float(), _float(bias))
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp16"


_LINEARS = {"int8": Int8Linear, "fp16": Fp16Linear}


def _float(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach().float()


def quantized_linear(method: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    if method not in _LINEARS:
        raise ValueError(f"unknown quantization {method!r}; supported: {', '.join(QUANTIZATIONS)}")
    return _LINEARS[method](weight, bias)


def quantize_linears(module: nn.Module, method: str) -> int:
    """Replace every nn.Linear under `module` by its quantized form; returns how many."""
    return replace_linears(module, lambda w, b: quantized_linear(method, w, b))
