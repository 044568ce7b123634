"""Swapping a model's nn.Linear layers for another implementation after its weights load
(quantized: model/quant.py; packed: model/packed.py)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def replace_linears(module: nn.Module,
                    make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]) -> int:
    """Replace every nn.Linear under `module` by make(weight, bias); returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child.weight, child.bias))
            count += 1
        else:
            count += replace_linears(child, make)
    return count
