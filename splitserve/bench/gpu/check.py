"""`python -m splitserve.bench.gpu.check`: the GPU check's steps, each printing its lines.

1. floors: HBM (or RAM) bandwidth by a device-to-device copy, matmul peak by a large matmul;
2. greedy equality with transformers (float32): tiny-random and a 2-layer Llama-shaped
   dummy model, the same random weights in both (bench/hf_equality.py);
3. `bench engine --load-format dummy` on the Llama-3-8B config: decode ms/step per batch at
   a 1k context and prefill tok/s at 2k tokens, each against its floor; tiny-random's decode
   step at batch 1, with decode graphs and with --enforce-eager;
4. `splitserve up` (a CTX and a GEN on the one device, KV over tcp) answering greedy chats
   equal to an aggregated worker's, with the GEN's KV transfer time per request.
`--cpu-dry-run` runs every step on the CPU with small shapes, to know the script works.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from splitserve.bench.gpu import floors, models


@dataclass(frozen=True)
class Plan:
    """Sizes per mode: the real check, or the CPU dry run of the same steps."""
    device: str
    big_model: str              # the bench engine step's model (a models.MODELS name)
    dtype: str
    batches: tuple[int, ...]
    context: int
    prefill: int
    kv_cache_gib: float
    copy_bytes: int
    matmul_n: int
    memory_fraction: str        # --gpu-memory-utilization of each worker of the up step


GPU = Plan("cuda", "llama-3-8b", "bfloat16", (1, 8, 64, 256), 1024, 2048, 40.0, 4 << 30, 8192,
           "0.3")
DRY = Plan("cpu", "tiny-llama", "float32", (1, 4), 64, 128, 0.25, 256 << 20, 1024, "")


def engine_flags(plan: Plan) -> list[str]:
    """--device where this checkout's engine takes it; the CPU needs none."""
    from splitserve.config import EngineConfig
    from splitserve.flags import config_flags
    if "--device" in config_flags(EngineConfig):
        return ["--device", plan.device]
    if plan.device != "cpu":
        sys.exit("gpu check: this checkout's engine has no --device flag; it runs on the CPU only")
    return []


def splitserve(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "splitserve.cli", "--log-level", "WARNING",
                           *args], check=True, **kwargs)


def step_floors(plan: Plan) -> tuple[float, float]:
    bw = floors.copy_bandwidth(plan.device, plan.copy_bytes)
    peak = floors.matmul_peak(plan.device, plan.matmul_n, plan.dtype)
    print(f"floors on {plan.device}: copy bandwidth {bw / 1e9:.1f} GB/s (read + write, "
          f"{plan.copy_bytes >> 20} MiB), {plan.dtype} matmul {peak / 1e12:.2f} TFLOP/s "
          f"({plan.matmul_n}^3)")
    return bw, peak


def step_equality(plan: Plan, folders: dict[str, str]) -> bool:
    from splitserve.bench.hf_equality import check
    engine_flags(plan)    # refuses a device this checkout's engine cannot run on
    results = [check(folders[name], "dummy", plan.device) for name in ("tiny-random", "tiny-llama")]
    for r in results:
        print("equality: " + r.line())
    return all(r.equal == r.prompts for r in results)


def bench(plan: Plan, folder: str, batches, out: str, kv_cache_gib: float,
          *extra: str) -> dict:
    splitserve("bench", "engine", "--model", folder, "--load-format", "dummy",
               "--dtype", plan.dtype, *engine_flags(plan), *extra,
               "--batch-sizes", ",".join(map(str, batches)),
               "--decode-prompt-len", str(plan.context), "--prefill-len", str(plan.prefill),
               "--decode-steps", "16", "--repeats", "3", "--kv-cache-gib", str(kv_cache_gib),
               "--json", out)
    with open(out) as f:
        return json.load(f)


def step_bench(plan: Plan, folders: dict[str, str], bw: float, peak: float, work: str) -> None:
    from splitserve.model.loader import load_model_source
    cfg = load_model_source(folders[plan.big_model], "dummy").config
    size = 2 if plan.dtype in ("bfloat16", "float16") else 4
    r = bench(plan, folders[plan.big_model], plan.batches, os.path.join(work, "big.json"),
              plan.kv_cache_gib)
    for b in plan.batches:
        ms = r["decode_ms_step"][str(b)]
        floor = 1000 * floors.decode_bytes(cfg, size, b, plan.context) / bw
        print(f"decode {plan.big_model} batch {b:>3}, context {plan.context}: {ms:8.2f} ms/step,"
              f" floor {floor:.2f} ms: {ms / floor:.2f}x the floor, {floor / ms:.0%} of the "
              f"bandwidth-bound token rate")
    tps = r["prefill_tok_s"]
    floor_tps = plan.prefill * peak / floors.prefill_flops(cfg, plan.prefill)
    print(f"prefill {plan.big_model} {plan.prefill} tokens: {tps:9.0f} tok/s, "
          f"{tps / floor_tps:.0%} of the matmul peak's {floor_tps:.0f} tok/s")
    tiny = {}   # tiny-random's decode step as served, then with every step eager
    for name, extra in (("default", ()), ("eager", ("--enforce-eager",))):
        tiny[name] = bench(plan, folders["tiny-random"], (1,),
                           os.path.join(work, f"tiny-{name}.json"), 1.0, *extra)
    default = "with decode graphs" if tiny["default"]["decode_graphs"] else "eager (no graphs here)"
    print(f"decode tiny-random batch 1: {tiny['default']['decode_ms_step']['1']:.2f} ms/step "
          f"{default}, {tiny['eager']['decode_ms_step']['1']:.2f} ms/step with --enforce-eager")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitserve.bench.gpu.check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prepared", help="the folder scripts/gpu_wheels.sh filled (.gpu_wheels)")
    p.add_argument("--cpu-dry-run", action="store_true", help="every step, small, on the CPU")
    p.add_argument("--skip", default="", help="comma-separated steps not to run: "
                                              "equality, bench, up")
    args = p.parse_args(argv)
    plan, skip = (DRY if args.cpu_dry_run else GPU), set(filter(None, args.skip.split(",")))
    work = tempfile.mkdtemp(prefix="gpu-check-")
    folders = models.assemble(args.prepared, work)
    from splitserve.bench.gpu.cluster import step_up
    ok = True
    bw, peak = step_floors(plan)
    if "equality" not in skip:
        ok &= step_equality(plan, folders)
    if "bench" not in skip:
        step_bench(plan, folders, bw, peak, work)
    if "up" not in skip:
        ok &= step_up(["--model", folders["tiny-llama"], "--load-format", "dummy",
                       "--dtype", "float32"], engine_flags(plan), plan.memory_fraction, work)
    print(f"gpu check: {'PASS' if ok else 'FAIL'} (logs and results in {work})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
