"""Run by test_native_pool.py in a process of its own (the kernels' helper thread, once
started, lasts as long as its process): the float32 kernels with the helper on another CPU,
against float64. Prints one JSON line."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from splitserve.model import native_attention, native_linear, native_pool
from test_native_kernels import CASES, DECODE_CASES, _decode_case, _paged_case

LINEAR_SHAPES = [(960, 576, 1), (576, 1536, 8), (3072, 576, 128), (49152, 576, 3),
                 (100, 64, 33), (7, 64, 2)]   # (out, in, rows): decode, prefill, lm_head, tails


def alone(fn):
    """fn() with the helper out of the kernels' way: the result each computes alone."""
    pool, native_pool._started = native_pool._started, None
    try:
        return fn()
    finally:
        native_pool._started = pool


def linear_error(shapes, seed: int = 0) -> tuple[float, bool]:
    """The largest error against float64, and whether every output equals the kernel's
    alone bit for bit."""
    g = torch.Generator().manual_seed(seed)
    worst, same = 0.0, True
    for i, (n, k, m) in enumerate(shapes):
        w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
        b = torch.randn(n, generator=g) if i % 2 else None
        layer = native_linear.NativeLinear.create(w, b)
        KEEP.append(layer)
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        out = layer(x)
        worst = max(worst, (out.double() - ref).abs().max().item())
        same &= torch.equal(out, alone(lambda: layer(x)))
    return worst, same


KEEP = []   # every cache the kernels read lives as long as the process, as the engine's does


def attention_error() -> tuple[float, bool]:
    worst, same = 0.0, True
    for case in CASES:
        q, cache, table, ref = _paged_case(*case)
        KEEP.append(cache)

        def run():
            return native_attention.prefill(q, cache, 1, table, case[4], case[6],
                                            case[2] ** -0.5)
        out = run()
        worst = max(worst, (out - ref).abs().max().item())
        same &= torch.equal(out, alone(run))
    return worst, same


def decode_error() -> tuple[float, bool]:
    worst, same = 0.0, True
    for case in DECODE_CASES:
        q, cache, meta, ref = _decode_case(*case)
        KEEP.append(cache)

        def run():
            return native_attention.decode(q, cache, 1, meta.decode_block_table,
                                           meta.decode_positions, case[5], case[2] ** -0.5)
        out = run()
        worst = max(worst, (out - ref).abs().max().item())
        same &= torch.equal(out, alone(run))
    return worst, same


def decode_batch(cache, sequences: int, blocks: int, seed: int):
    """Decode queries of `sequences` sequences of `blocks` blocks each, over `cache`."""
    g = torch.Generator().manual_seed(seed)
    bs, num_blocks = cache.shape[3], cache.shape[0]
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:blocks]
                          for _ in range(sequences)])
    positions = torch.full((sequences,), blocks * bs - 1, dtype=torch.int64)
    q = torch.randn(sequences, 9, 64, generator=g)
    return lambda: native_attention.decode(q, cache, 1, tables, positions, None, 0.125)


def take_back(layer, x, stall) -> float:
    """Runs `layer` until the engine thread takes a range back from a helper stalled for
    1 s in it; when that was seen (the helper then holds a stale range for about 1 s)."""
    before, t_end = native_pool.stats()[1], time.monotonic() + 10
    stall(1_000_000_000)
    while native_pool.stats()[1] == before and time.monotonic() < t_end:
        layer(x)
    assert native_pool.stats()[1] > before, "no range was taken back"
    return time.monotonic()


def main() -> None:
    engine_cpu, helper_cpu = int(sys.argv[1]), int(sys.argv[2])
    os.sched_setaffinity(0, {engine_cpu})
    torch.set_num_threads(1)
    result = {"started": native_pool.start(helper_cpu)}
    runs = [linear_error(LINEAR_SHAPES, seed) for seed in range(3)]
    result["linear_err"] = max(err for err, _ in runs)
    result["linear_same"] = all(same for _, same in runs)
    result["attention_err"], result["attention_same"] = attention_error()
    result["decode_err"], result["decode_same"] = decode_error()
    result["helped"] = native_pool.stats()[0]

    # The helper loses its CPU for 2 s right after claiming a range: the engine thread must
    # take that range back and go on, not wait for it.
    stall = native_pool._library().pool_stall_next
    stall.argtypes = [ctypes.c_int64]
    stall(2_000_000_000)
    big = native_linear.NativeLinear.create(torch.randn(49152, 576))
    x = torch.randn(1, 576)
    slowest, t_end, before = 0.0, time.monotonic() + 10, native_pool.stats()[1]
    while native_pool.stats()[1] == before and time.monotonic() < t_end:
        t = time.perf_counter()
        big(x)
        slowest = max(slowest, time.perf_counter() - t)
    result["taken_back"] = native_pool.stats()[1] - before
    result["slowest_call_s"] = slowest
    time.sleep(2.2)   # the stalled helper wakes, finishes its stale range and drops it

    # The same in attention, and while the helper sleeps, linears overwrite the staging
    # copies its stale range reads: it must still read only block ids of the cache.
    q, cache, table, _ = _paged_case(*CASES[1])
    KEEP.append(cache)
    before = native_pool.stats()[1]
    stall(1_000_000_000)
    t_end = time.monotonic() + 10
    while native_pool.stats()[1] == before and time.monotonic() < t_end:
        native_attention.prefill(q, cache, 1, table, CASES[1][4], None, 0.125)
    result["attention_taken_back"] = native_pool.stats()[1] - before
    wide = native_linear.NativeLinear.create(torch.full((3072, 576), 1e30))
    KEEP.append(wide)
    t_end = time.monotonic() + 1.5
    while time.monotonic() < t_end:
        wide(torch.full((256, 576), -1e30))   # inputs that make no block id
    # And in decode: the stale sequence's positions and table are read where a later batch
    # of fewer, longer sequences put its table (block ids as positions, a row past its own).
    cache = torch.randn(200, 3, 2, 16, 3, 64)
    KEEP.append(cache)
    short, long = decode_batch(cache, 16, 2, seed=1), decode_batch(cache, 2, 64, seed=2)
    before = native_pool.stats()[1]
    stall(1_000_000_000)
    t_end = time.monotonic() + 10
    while native_pool.stats()[1] == before and time.monotonic() < t_end:
        short()
    result["decode_taken_back"] = native_pool.stats()[1] - before
    t_end = time.monotonic() + 1.5
    while time.monotonic() < t_end:
        long()

    # Memory a stale range reads is freed only once the helper has left it: a linear of
    # 113 MB of tiles (mmap'd, so unmapped when freed: a late read dies of SIGSEGV) ...
    big = native_linear.NativeLinear.create(torch.randn(49152, 576))
    t_taken = take_back(big, torch.randn(1, 576), stall)
    native_pool.quiesce()
    result["quiesce_waited_s"] = time.monotonic() - t_taken
    del big
    # ... and an engine's model and KV cache, which its runner frees when it goes.
    from splitserve.engine.core import EngineCore
    from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
    engine = EngineCore(EngineConfig(model="tiny-random", dtype="float32", seed=0,
                                     cache=CacheConfig(4, 64, enable_prefix_caching=False),
                                     scheduler=SchedulerConfig(16, 4)))
    layer = next(m for m in engine.runner.model.modules()
                 if isinstance(m, native_linear.NativeLinear) and m.out_features > 1000)
    t_taken = take_back(layer, torch.randn(1, layer.in_features), stall)
    del layer, engine
    gc.collect()
    result["runner_freed_after_s"] = time.monotonic() - t_taken

    result["linear_err_after"], result["linear_same_after"] = linear_error(LINEAR_SHAPES, 7)
    result["decode_err_after"], result["decode_same_after"] = decode_error()
    result["attention_err_after"], result["attention_same_after"] = attention_error()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
