"""`splitserve bench planner`: goodput on a workload whose input:output ratio swings, for
every fixed split of N workers between the context and generation pools and for the
planner (`up --planner`, starting from one split).

Each setup runs alone: `splitserve up` on the model with its split, the swing workload
(`bench serve --workload swing`: --input-len / --output-len, swapped every
--swing-period seconds) at the same load, for --duration seconds, then `up` stops before
the next setup starts. Goodput is DistServe's (requests per second meeting every --goodput
bound). While a setup runs, its pool sizes are read off the orchestrator's /health every
second (the planner's moves), and each request's SLO verdict is kept with its start time,
so the JSON has a timeline of both (and --plot draws it).

The line that matters: the planner's goodput over the best fixed split's (target >= 1.3),
and the share of its requests within the SLO (target >= 90%).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from dataclasses import dataclass

import aiohttp

from splitserve.bench import metrics as M
from splitserve.bench import provenance
from splitserve.bench.serve.main import ServeBenchConfig, benchmark
from splitserve.bench.serve.workloads import WorkloadConfig
from splitserve.bench.server_process import ServerProcess, free_port

TARGET_RATIO = 1.3
TARGET_WITHIN = 0.9
BUCKET = 10.0            # seconds per point of the SLO-attainment timeline


@dataclass(frozen=True)
class Setup:
    num_ctx: int
    num_gen: int
    planner: bool = False

    @property
    def name(self) -> str:
        return f"planner (from {self.num_ctx}:{self.num_gen})" if self.planner \
            else f"fixed {self.num_ctx}:{self.num_gen}"


def parse_split(text: str) -> tuple[int, int]:
    ctx, sep, gen = text.partition(":")
    try:
        split = int(ctx), int(gen)
    except ValueError:
        split = (0, 0)
    if not sep or min(split) < 1:
        raise ValueError(f"a split is CTX:GEN, each at least 1, got {text!r}")
    return split


def setups(workers: int, start: str, fixed: str | None) -> list[Setup]:
    splits = ([parse_split(s) for s in fixed.split(",")] if fixed
              else [(c, workers - c) for c in range(1, workers)])
    begin = parse_split(start)
    if any(c + g != workers for c, g in splits + [begin]):
        raise ValueError(f"every split must add up to --workers {workers}")
    return [Setup(c, g) for c, g in splits] + [Setup(*begin, planner=True)]


def up_command(setup: Setup, args, port: int) -> list[str]:
    cmd = ["up", "--model", args.model, "--num-ctx", str(setup.num_ctx),
           "--num-gen", str(setup.num_gen), "--port", str(port), "--threads", "1",
           "--kv-cache-gib", str(args.kv_cache_gib)]
    if setup.planner:
        slo = M.parse_goodput(args.goodput)
        cmd += ["--planner", "--planner-interval", str(args.planner_interval),
                "--planner-window", str(args.planner_window),
                "--planner-cooldown", str(args.planner_cooldown)]
        for key, flag in (("ttft", "--ttft-p90-ms"), ("itl", "--itl-p90-ms")):
            bound = slo.get(key, slo.get("tpot") if key == "itl" else None)
            if bound is not None:
                cmd += [flag, f"{bound * 1000:g}"]
    return cmd


async def pool_sizes(session: aiohttp.ClientSession, url: str, out: list, every: float = 1.0):
    """(seconds since start, healthy ctx, healthy gen) every `every` seconds, until cancelled."""
    start = time.monotonic()
    while True:
        try:
            async with session.get(url + "/health") as r:
                healthy = (await r.json(content_type=None)).get("healthy", {})
                out.append((round(time.monotonic() - start, 1), len(healthy.get("ctx", [])),
                            len(healthy.get("gen", []))))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            pass
        await asyncio.sleep(every)


async def _measure(cfg: ServeBenchConfig) -> tuple[dict, list]:
    sizes: list = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        poll = asyncio.create_task(pool_sizes(session, cfg.url, sizes))
        try:
            result = await benchmark(cfg)
        finally:
            poll.cancel()
    return result, sizes


def attainment(requests: list[dict], slo: dict[str, float]) -> list[tuple[float, float, int]]:
    """(bucket start s, share of the requests started in it that met the SLO, their count)."""
    buckets: dict[int, list[bool]] = {}
    for r in requests:
        rec = M.RequestRecord(**r)
        ok = rec.error is None and M.meets_slo(rec, slo)
        buckets.setdefault(int(rec.start // BUCKET), []).append(ok)
    return [(k * BUCKET, sum(v) / len(v), len(v)) for k, v in sorted(buckets.items())]


def wait_whole(url: str, setup: Setup, timeout: float) -> None:
    """Until the orchestrator counts every worker of the setup healthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                healthy = json.loads(r.read())["healthy"]
            if (len(healthy["ctx"]), len(healthy["gen"])) == (setup.num_ctx, setup.num_gen):
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{setup.name}: the workers did not all join in {timeout:.0f} s")


def run_setup(setup: Setup, args) -> dict:
    port = free_port()
    up = ServerProcess(up_command(setup, args, port), port)
    try:
        up.wait_healthy(args.start_timeout)
        wait_whole(up.url, setup, args.start_timeout)
        workload = WorkloadConfig(kind="swing", input_len=args.input_len,
                                  output_len=args.output_len, swing_period=args.swing_period,
                                  seed=args.seed)
        cfg = ServeBenchConfig(url=up.url, workload=workload, concurrency=args.concurrency,
                               num_requests=None, duration=args.duration,
                               slo=M.parse_goodput(args.goodput), label=setup.name,
                               progress=False)
        result, sizes = asyncio.run(_measure(cfg))
    finally:
        up.close()
    m = result["metrics"]
    done = m["completed"] + m["failed"]
    return {"setup": setup.name, "num_ctx": setup.num_ctx, "num_gen": setup.num_gen,
            "planner": setup.planner, "metrics": m,
            "metrics_by_class": result["metrics_by_class"],
            "within_slo": (m["goodput"] * m["duration_s"] / done) if done else 0.0,
            "pool_sizes": sizes, "attainment": attainment(result["requests"], cfg.slo)}


def summary(runs: list[dict]) -> dict:
    fixed = [r for r in runs if not r["planner"]]
    planned = [r for r in runs if r["planner"]]
    best = max(fixed, key=lambda r: r["metrics"]["goodput"] or 0.0) if fixed else None
    if not planned or best is None or not best["metrics"]["goodput"]:
        return {"best_fixed": best and best["setup"], "ratio": None}
    ratio = (planned[0]["metrics"]["goodput"] or 0.0) / best["metrics"]["goodput"]
    return {"best_fixed": best["setup"], "ratio": ratio,
            "ratio_pass": ratio >= TARGET_RATIO,
            "planner_within_slo": planned[0]["within_slo"],
            "within_pass": planned[0]["within_slo"] >= TARGET_WITHIN}


def format_table(result: dict) -> str:
    lines = [f"{'setup':22s} {'goodput':>8s} {'in SLO':>7s} {'req/s':>7s} {'out tok/s':>9s} "
             f"{'TTFT p90':>9s} {'ITL p90':>8s} {'failed':>6s}"]
    for r in result["runs"]:
        m = r["metrics"]
        lines.append(f"{r['setup']:22s} {m['goodput'] or 0:8.2f} {r['within_slo']:7.0%} "
                     f"{m['request_throughput']:7.2f} {m['output_throughput']:9.1f} "
                     f"{m['ttft_ms']['p90'] or 0:9.0f} {m['itl_ms']['p90'] or 0:8.1f} "
                     f"{m['failed']:6d}")
    s = result["summary"]
    if s["ratio"] is not None:
        lines.append(f"{'PASS' if s['ratio_pass'] else 'FAIL'}  planner goodput / best fixed "
                     f"({s['best_fixed']}): {s['ratio']:.2f} (target >= {TARGET_RATIO})")
        lines.append(f"{'PASS' if s['within_pass'] else 'FAIL'}  planner requests within SLO: "
                     f"{s['planner_within_slo']:.0%} (target >= {TARGET_WITHIN:.0%})")
    return "\n".join(lines)


def plot(result: dict, path: str) -> str:
    """Pool sizes of the planner's run and SLO attainment of every run over time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for r in result["runs"]:
        if r["planner"] and r["pool_sizes"]:
            t, ctx, gen = zip(*r["pool_sizes"])
            top.step(t, ctx, where="post", label="context workers")
            top.step(t, gen, where="post", label="generation workers")
        if r["attainment"]:
            t, share, _ = zip(*r["attainment"])
            bottom.plot(t, [100 * s for s in share], marker="o", label=r["setup"])
    period = result["config"]["swing_period"]
    for ax in (top, bottom):
        for k in range(int(result["config"]["duration"] // period) + 1):
            if k % 2:
                ax.axvspan(k * period, (k + 1) * period, color="0.92", zorder=0)
    top.set_ylabel("planner's pools")
    top.legend(loc="upper right")
    bottom.set_ylabel("% of requests within SLO")
    bottom.set_xlabel(f"seconds (shaded: {result['config']['output_len']}:"
                      f"{result['config']['input_len']} input:output; else the reverse)")
    bottom.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--workers", type=int, default=4, help="CTX + GEN workers of every setup")
    p.add_argument("--splits", default=None, metavar="C:G,...",
                   help="the fixed splits to run (default: every one of --workers)")
    p.add_argument("--planner-start", default=None, metavar="C:G",
                   help="the planner's first split (default: an even one)")
    p.add_argument("--goodput", nargs="+", default=["ttft:2000", "itl:200"], metavar="KEY:MS",
                   help="the SLO, as `bench serve --goodput`; ttft and itl (else tpot) are "
                        "the planner's (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=100)
    p.add_argument("--swing-period", type=float, default=60.0)
    p.add_argument("--duration", type=float, default=240.0, help="seconds per setup")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gib", type=float, default=0.25)
    p.add_argument("--planner-interval", type=float, default=1.0)
    p.add_argument("--planner-window", type=float, default=15.0)
    p.add_argument("--planner-cooldown", type=float, default=10.0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--json", default=None, help="default: bench-results/planner-<time>.json")
    p.add_argument("--plot", default=None, help="default: the --json path with .png")


def run(args) -> int:
    try:
        M.parse_goodput(args.goodput)
        plan = setups(args.workers, args.planner_start
                      or f"{args.workers // 2}:{args.workers - args.workers // 2}", args.splits)
    except ValueError as exc:
        raise SystemExit(f"splitserve bench planner: {exc}") from None
    runs = []
    for setup in plan:
        print(f"-- {setup.name}", flush=True)
        runs.append(run_setup(setup, args))
    result = {"bench": "planner", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "versions": provenance.versions(), "machine": provenance.machine(),
              "config": {k: v for k, v in vars(args).items() if k != "func"},
              "runs": runs, "summary": summary(runs)}
    path = args.json or os.path.join("bench-results",
                                     f"planner-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(format_table(result))
    print(f"results: {path}")
    if args.plot != "none":
        print(f"plot: {plot(result, args.plot or os.path.splitext(path)[0] + '.png')}")
    return 0
