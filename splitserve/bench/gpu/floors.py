"""What a card can do at best, measured, and what a model's step must move or compute.

Decode is bound by memory bandwidth: a step reads every weight a token passes through and
every KV byte of every sequence. Prefill is bound by matmul throughput. The floors are
measured in the same run as the engine (a large device-to-device copy, a large matmul), so
the ratios carry over between cards; the bytes and FLOPs are counted from the config.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from splitserve.model.config import ModelConfig


def _timed(device: str, fn: Callable[[], object], reps: int) -> float:
    """Median seconds of fn() after one warm-up, the device synchronized around each."""
    import torch
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: str, nbytes: int, reps: int = 5) -> float:
    """Bytes/s of a device-to-device copy, counting the bytes read and those written."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(device, lambda: dst.copy_(src), reps)


def matmul_peak(device: str, n: int, dtype: str, reps: int = 5) -> float:
    """FLOP/s of an n x n x n matmul in dtype."""
    import torch
    a = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
    b = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
    return 2 * n ** 3 / _timed(device, lambda: a @ b, reps)


def layer_params(cfg: ModelConfig) -> int:
    """Weights of the decoder layers' linear layers (norms and biases are negligible)."""
    d = cfg.hidden_size
    attn = d * (2 * cfg.q_size + 2 * cfg.kv_size)          # q, k, v, o
    return cfg.num_layers * (attn + 3 * d * cfg.intermediate_size)


def decode_bytes(cfg: ModelConfig, dtype_bytes: int, batch: int, context: int) -> int:
    """Bytes one decode step reads at least: the layers, the lm_head (the embedding table
    when tied; an untied table gives only the batch's rows) and each sequence's KV."""
    weights = layer_params(cfg) + cfg.vocab_size * cfg.hidden_size
    return dtype_bytes * weights + batch * context * cfg.kv_bytes_per_token(dtype_bytes)


def prefill_flops(cfg: ModelConfig, tokens: int) -> int:
    """FLOPs of one prompt's prefill: every token through the layers, causal attention
    (QK^T and PV over half the square), and the last token's logits."""
    attention = 2 * cfg.num_layers * tokens * tokens * cfg.q_size
    return 2 * tokens * layer_params(cfg) + attention + 2 * cfg.vocab_size * cfg.hidden_size
