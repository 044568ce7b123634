"""`splitserve bench engine`: prefill and decode throughput of the engine alone, in-process.

Prefill: one prompt of --prefill-len tokens at a time (chunked by the token budget), timed
from admission to first token. Decode: B requests admitted and prefilled first, then only
decode steps are timed; tok/s = B / median step time. Each decode batch also gets its memory
floor (floor.py): the bytes a step must read over the read bandwidth measured in the same
run, and the step's time as a multiple of it.

The machines this runs on are shared, so each measurement also reports how many cores other
processes kept busy meanwhile (Linux /proc/stat); above ~0.2 the numbers say more about the
neighbours than about the engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from typing import TYPE_CHECKING

import numpy as np

from splitserve import placement
from splitserve.bench.engine import floor
from splitserve.kernels import build
from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.flags import add_flags, from_flags
from splitserve.protocol.engine import EngineRequest
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens

if TYPE_CHECKING:
    from splitserve.engine.core import EngineCore


def _prompt(rng, n: int, vocab: int) -> PromptTokens:
    return PromptTokens(rng.integers(3, min(vocab, 32000), n).astype(np.int32))


def _busy_cpu_seconds() -> float | None:
    """CPU seconds all processes have used since boot; None where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")   # minus idle, iowait


def _measure(fn):
    """-> (fn(), cores other processes kept busy while it ran, or None if unknown)."""
    busy0, own0, t0 = _busy_cpu_seconds(), time.process_time(), time.perf_counter()
    out = fn()
    wall, own, busy1 = time.perf_counter() - t0, time.process_time() - own0, _busy_cpu_seconds()
    other = None if busy0 is None else max(0.0, busy1 - busy0 - own) / wall
    return out, other


def _drain(engine: EngineCore) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def bench_prefill(engine: EngineCore, length: int, repeats: int, rng) -> float:
    times = []
    params = SamplingParams(temperature=0, max_tokens=1)
    for i in range(repeats + 1):
        prompt = _prompt(rng, length, engine.model_config.vocab_size)
        engine.add_request(EngineRequest.build(f"p{i}", prompt, params))
        t0 = time.perf_counter()
        _drain(engine)
        if i:   # the first run warms up
            times.append(time.perf_counter() - t0)
    return length / statistics.median(times)


def bench_decode(engine: EngineCore, batch: int, steps: int, prompt_len: int, rng) -> float:
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        prompt = _prompt(rng, prompt_len, engine.model_config.vocab_size)
        engine.add_request(EngineRequest.build(f"d{batch}-{i}", prompt, params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    _drain(engine)
    return batch / statistics.median(times[1:])


def _machine() -> dict:
    import torch
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "avx512_bf16": getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)(),
            "amx": getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "processor": platform.processor() or platform.machine()}


def _helper_note() -> str:
    from splitserve.model import native_pool
    cpu = native_pool.helper_cpu()
    return "" if cpu is None else f", borrowing CPU {cpu}'s idle time"


def place(args) -> None:
    """With --cpus, pins this process there (the command line's process only: pins are
    inherited), e.g. to the CPUs `serve` gives its engine, so the two compare."""
    if args.cpus:
        placement.pin_process(args.cpus, "bench engine")


def engine_config(args) -> EngineConfig:
    """The flags' engine, seeded, with no prefix caching (every prefill computes), one whole
    prefill per step and room for the largest decode batch."""
    cache = dataclasses.replace(from_flags(CacheConfig, args), enable_prefix_caching=False)
    return from_flags(EngineConfig, args, seed=0, cache=cache,
                      scheduler=SchedulerConfig(max_num_batched_tokens=args.prefill_len,
                                                max_num_seqs=max(args.batch_sizes)))


def run(args) -> dict:
    # The model's imports (torch) load here, not when `splitserve` builds its command line.
    from splitserve.bench.engine import plain_reference
    from splitserve.engine.core import EngineCore
    config = engine_config(args)
    engine = EngineCore(config)
    import torch
    if (args.helper_cpu is not None and torch.get_num_threads() == 1
            and engine.runner.kv_cache.dtype == torch.float32):
        from splitserve.model import native_pool
        native_pool.start(args.helper_cpu)
    rng = np.random.default_rng(0)
    result = _describe(engine, config, args)
    print(_headline(result))
    if args.sampler:
        return _write(args, {**result, "sampler_ms": _sampler(engine, args)})
    tps, other = _measure(lambda: bench_prefill(engine, args.prefill_len, args.repeats, rng))
    result["prefill_tok_s"], result["other_cores_busy"]["prefill"] = tps, other
    print(f"  prefill {args.prefill_len} tokens: {tps:7.1f} tok/s{_load_note(other)}")
    if args.plain_reference:
        tps, other = _measure(lambda: plain_reference.prefill_tok_s(
            engine.model_config, config.torch_dtype, args.prefill_len, args.repeats))
        result["plain_reference_prefill_tok_s"] = tps
        result["other_cores_busy"]["plain_reference"] = other
        print(f"  plain PyTorch forward of the same shapes, {args.prefill_len} tokens: "
              f"{tps:7.1f} tok/s{_load_note(other)}")
    result["memory_floor"] = floor_info = _floor(engine, args, result)
    for b in args.batch_sizes:
        tps, other = _measure(lambda: bench_decode(engine, b, args.decode_steps,
                                                   args.decode_prompt_len, rng))
        ms = 1000 * b / tps
        result["decode_tok_s"][str(b)], result["decode_ms_step"][str(b)] = tps, ms
        result["other_cores_busy"][str(b)] = other
        low = floor_info["floor_ms"][str(b)]
        floor_info["over_floor"][str(b)] = ms / low
        print(f"  decode batch {b:>3}: {tps:7.1f} tok/s  ({ms:.1f} ms/step; memory floor "
              f"{low:.1f} ms, {ms / low:.1f}x){_load_note(other)}")
    return _write(args, result)


def _floor(engine: EngineCore, args, result: dict) -> dict:
    """Bytes each decode batch's step reads (at its mean context over the timed steps) and
    the read bandwidth measured now."""
    import torch
    cfg = engine.model_config
    weights = args.quantization if args.quantization == "int8" else result["dtype"]
    kv_bytes = torch.empty((), dtype=engine.runner.kv_cache.dtype).element_size()
    context = args.decode_prompt_len + args.decode_steps // 2
    bandwidth = floor.read_bandwidth()
    steps = {str(b): floor.step_bytes(cfg, weights, kv_bytes, b, context)
             for b in args.batch_sizes}
    print(f"  memory floor: {floor.weight_bytes(cfg, weights) / 1e6:.0f} MB of {weights} "
          f"weights a step, read at {bandwidth / 1e9:.1f} GB/s ({torch.get_num_threads()} "
          f"thread(s), measured now)")
    return {"read_gb_s": bandwidth / 1e9, "weights": weights,
            "weight_bytes": floor.weight_bytes(cfg, weights), "context": context,
            "step_bytes": steps, "floor_ms": {b: 1000 * n / bandwidth for b, n in steps.items()},
            "over_floor": {}}


def _write(args, result: dict) -> dict:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _sampler(engine: EngineCore, args) -> dict:
    from splitserve.bench.engine.sampler_timing import sampler_ms
    ms = sampler_ms(engine.model_config.vocab_size, args.batch_sizes,
                    engine=engine if args.grammar else None)
    for kind, per_batch in ms.items():
        print(f"  sampler, {kind:>8} rows: " + ", ".join(
            f"batch {b} {t:.3f} ms" for b, t in per_batch.items()))
    return ms


def _describe(engine: EngineCore, config: EngineConfig, args) -> dict:
    return {"model": engine.model_config.name, "dtype_requested": args.dtype,
            "dtype": str(config.torch_dtype).removeprefix("torch."),
            "device": engine.runner.platform.describe(),
            "quantization": args.quantization, "packed_weights": engine.runner.model.packed,
            "decode_graphs": engine.runner.graphs is not None,
            "kernels": build.status() + _helper_note(),
            "threads": args.threads, "cpus": placement.format_cpus(tuple(os.sched_getaffinity(0))),
            **_machine(),
            "prefill_len": args.prefill_len, "decode_prompt_len": args.decode_prompt_len,
            "decode_tok_s": {}, "decode_ms_step": {}, "other_cores_busy": {}}


def _headline(r: dict) -> str:
    # The flags alone mislead where ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA hold torch lower.
    import torch
    from splitserve.platforms.cpu import auto_dtype
    native = "native" if auto_dtype() == torch.bfloat16 else "no native"
    layout = ", packed" if r["packed_weights"] else ""
    return (f"{r['model']}: {r['quantization'] or r['dtype']}{layout} weights, dtype {r['dtype_requested']}"
            f" -> {r['dtype']} on {r['device']}, {r['torch_threads']} threads on CPUs {r['cpus']}, "
            f"CPU {r['cpu_capability']} "
            f"({native} bfloat16), {r['kernels']}")


def _load_note(other: float | None) -> str:
    return "" if other is None else f"   [other processes: {other:.2f} cores busy]"


def add_arguments(p) -> None:
    add_flags(p, EngineConfig, "--model", "--device", "--load-format", "--dtype",
              "--gpu-memory-utilization", "--quantization", "--no-pack-weights", "--threads",
              "--kv-cache-gib", "--enforce-eager", "--cuda-graph-max-batch",
              help={"--threads": "torch threads (default: torch's, all cores)",
                    "--kv-cache-gib": "KV cache size in GiB: room for the largest decode batch "
                                      "at --decode-prompt-len"})
    p.add_argument("--cpus", type=placement.cpu_list_argument, default=None,
                   help="pin to these CPUs, e.g. those `serve` logs for its engine")
    p.add_argument("--helper-cpu", type=int, default=None,
                   help="with one thread in float32, the kernels borrow this CPU's idle time "
                        "as `serve`'s engine borrows its front-end's (the CPU it logs)")
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--decode-prompt-len", type=int, default=64)
    p.add_argument("--plain-reference", action="store_true",
                   help="also time a plain PyTorch forward of the model's shapes (nn.Linear, "
                        "SDPA, random weights; splitserve/bench/engine/plain_reference.py) over "
                        "the same prompt length: what this machine does without the engine")
    p.add_argument("--sampler", action="store_true",
                   help="time the sampler alone instead (random logits of the model's "
                        "vocabulary; greedy, unseeded and seeded rows, per --batch-sizes)")
    p.add_argument("--grammar", action="store_true",
                   help="with --sampler: also greedy rows under a JSON schema (structured "
                        "output's token mask, filled and applied each step)")
    p.add_argument("--json", default=None, help="write the results here")
