"""The memory floor of a decode step: the bytes it must read (every linear's weights once,
and each sequence's KV so far) over the read bandwidth measured on this machine in the same
run. A step cannot be faster than that; how far above it a step runs is what is left to win.

Weights are counted from the model's shapes at the bytes per element the engine holds them
in (int8: one byte and a float32 scale per output channel; the packed layouts and the
bfloat16 row split keep the same elements, read once). The embedding table is read a row
per sequence (counted), the output projection whole. Norm weights, rotary tables and
activations are left out: together far under 1% here.
"""

from __future__ import annotations

import statistics
import time

WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp16": 2}
READ_BYTES = 512 << 20        # the buffer the bandwidth is measured over: far past any cache


def linear_elements(cfg) -> int:
    """Weight elements every decode step reads once (the layers' and the output's)."""
    per_layer = (cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
                 + 3 * cfg.hidden_size * cfg.intermediate_size)
    return cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size


def weight_bytes(cfg, weights: str) -> int:
    """Bytes of weights one decode step reads, held as `weights` (a dtype or quantization)."""
    elements = linear_elements(cfg)
    scales = 0
    if weights == "int8":   # a float32 scale per output channel of each linear
        per_layer = cfg.q_size + 2 * cfg.kv_size + cfg.hidden_size + 3 * cfg.intermediate_size
        scales = 4 * (cfg.num_layers * per_layer + cfg.vocab_size)
    return elements * WEIGHT_BYTES[weights] + scales


def step_bytes(cfg, weights: str, kv_dtype_bytes: int, batch: int, context: int) -> int:
    """One decode step of `batch` sequences that each hold `context` tokens."""
    embedding_rows = batch * cfg.hidden_size * WEIGHT_BYTES[weights]
    return (weight_bytes(cfg, weights) + embedding_rows
            + batch * context * cfg.kv_bytes_per_token(kv_dtype_bytes))


def read_bandwidth(passes: int = 5) -> float:
    """Bytes per second torch reads a 512 MiB float32 buffer at (a sum over it), with the
    threads the engine has; the median of `passes` after one to warm up."""
    import torch
    buf = torch.ones(READ_BYTES // 4, dtype=torch.float32)
    times = []
    for i in range(passes + 1):
        t0 = time.perf_counter()
        buf.sum()
        if i:
            times.append(time.perf_counter() - t0)
    return READ_BYTES / statistics.median(times)
