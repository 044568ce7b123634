"""Seeded draws as a pure function of (seed, token position): no generator state.

A seeded row's token at output position t (0 for the first generated token, counting tokens
a migrated stream resumed with) is drawn by inverting its probabilities' CDF at one uniform
u = U(seed, t), a counter-based hash of the two numbers (Philox's idea, as JAX's PRNG keys
use it). So the token depends on the row's probabilities, its seed and t only: not on what
else shares the batch, on which worker sampled the previous token (a CTX samples t = 0, a
GEN goes on from t = 1), nor on a migration that re-prefilled prompt + tokens so far. An
n > 1 request's sibling i samples with seed + i (engine/admission.sibling_params), so the
sequence index is part of the seed. Everything is torch integer and float ops on the
probabilities' device, vectorized over the batch's rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
# A 32-bit integer finalizer (xorshift-multiply, two rounds) whose multipliers are below
# 2**31, so every product of a 32-bit value fits in int64 on any device: no overflow.
_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)
_STREAMS = (0x3C6EF372, 0x5851F42D)   # keys the two 32-bit halves of u's 53 bits apart


def _mix32(x: Tensor) -> Tensor:
    """(N,) int64 values in [0, 2**32) -> well-mixed values in [0, 2**32)."""
    for m in _MULTIPLIERS:
        x = ((x ^ (x >> 16)) * m) & _MASK32
    return x ^ (x >> 15)


def _hash(seeds: Tensor, positions: Tensor, stream: int) -> Tensor:
    """32 well-mixed bits of (seed, position, stream), chained through each 32-bit word."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    h = _mix32((positions & _MASK32) ^ stream)
    h = _mix32(h ^ lo)
    return _mix32((h + hi) & _MASK32)


def uniforms(seeds: Tensor, positions: Tensor) -> Tensor:
    """(R,) float64 in [0, 1) with 53 random bits, each a pure function of its row's
    (seed, position): int64 seeds (any value) and positions (>= 0), on one device."""
    high = _hash(seeds, positions, _STREAMS[0]) >> 6          # 26 bits
    low = _hash(seeds, positions, _STREAMS[1]) >> 5           # 27 bits
    return ((high << 27) | low).double() * 2.0 ** -53


def sample(probs: Tensor, u: Tensor) -> Tensor:
    """probs: (R, V) rows of probabilities (zeros allowed); u: (R,) in [0, 1) -> (R,) the
    token whose CDF interval holds u: token i with probability probs[i] / probs.sum(). A
    token of probability 0 is never chosen (its interval is empty)."""
    # In the probabilities' own dtype: a float64 cumsum over the vocabulary cost 5x more.
    cdf = probs.cumsum(dim=-1)                                              # (R, V)
    total = cdf[:, -1:]                                                     # (R, 1)
    x = (u.unsqueeze(1) * total.double()).to(cdf.dtype)                     # (R, 1)
    # Rounding may carry x up to total: keep it strictly below, inside the last token's.
    x = torch.minimum(x, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(1)
