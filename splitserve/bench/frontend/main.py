"""`splitserve bench frontend`: what the GEN front-end costs per token relay mode, against
prompt length (ISL) and concurrency.

A GEN worker (started here, a fresh one per ISL; or one given with --url) runs with
--kv-backend none: a generation_only request gets its blocks, "pulls" nothing, takes its
first token from the request (max_tokens 1) and frees its blocks at once. What is left to
measure is the front-end's event loop: reading the body, decoding the relayed prompt (a
JSON int list, base64 int32, or only its length), checking it and handing it to the engine.

For every (ISL, mode, concurrency) a client in its own process sends pre-built bodies at
fixed concurrency over warm keep-alive connections, each with `X-Sent-At`, and reads the
worker's /metrics just before and after:

  server CPU / request  delta of the front-end process's process_cpu_seconds_total / requests
  gen_preprocessing     X-Sent-At -> engine admission (histogram down to 10 us): time queued
                        in front of the event loop counts, which is what grows with load
  queue                 engine admission -> blocks allocated: time the engine (its per-block
                        bookkeeping, the KV pool, max_num_seqs) held requests, not the front-end
  client latency        send -> whole response, and request/s

The load is a closed loop of one-token requests: every request in flight is in front of or
inside this one worker, so latencies grow as concurrency / throughput (Little's law); at
high concurrency they measure how fast the worker drains its queue, which is the point.
Every request must succeed and be counted by the worker under its mode; anything else ends
the benchmark with the reason. The bodies' own `prompt` field is a one-word stand-in: a
real orchestrator also relays the client's original prompt, the same cost in every mode.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from dataclasses import asdict

from splitserve.bench import provenance
from splitserve.bench.frontend.client import ClientProcess, RunSpec, Target
from splitserve.bench.frontend.config import (DEFAULT_CONCURRENCY, DEFAULT_ISL, MODES,
                                              MODES_LIGHT_FIRST,
                                              QUICK_CONCURRENCY, QUICK_ISL, BenchError,
                                              FrontendBenchConfig)
from splitserve.bench.frontend.report import (evaluate_targets, format_ms, format_table,
                                              format_targets, plot, summarize_run)
from splitserve.bench.frontend.worker import BenchWorker, check_kv_backend, get_json, tiny_layout

SKIP_NOTE = ("the KV pull was skipped (--kv-backend none): generation_only requests decode "
             "from stale blocks, so their output is garbage; only the front-end is measured")


# -- the benchmark ----------------------------------------------------------------------------
def benchmark(cfg: FrontendBenchConfig) -> dict:
    """Run the grid; the result document (runs, targets, worker, machine)."""
    layout, vocab_size, block_bytes = tiny_layout(cfg.block_size)
    load_start = os.getloadavg()   # the cores are shared with whatever else runs here
    # Lightest body first within each ISL, and a worker of its own per ISL when we start
    # it: a process that has held a thousand 128k-token JSON lists keeps a heap of GBs
    # (peak RSS 5.7 GB, 0.75-1.5 GB after) and serves everything after it slower (metadata
    # CPU/request up to 2x), which a deployment relaying in one mode never sees.
    modes = sorted(cfg.modes, key=MODES_LIGHT_FIRST.index)
    runs, workers, client = [], [], None
    # generation_only requests need a token derived from the internal secret: the worker
    # started here and the client process inherit this one (a worker given with --url: set
    # the variable to its)
    os.environ.setdefault("SPLITSERVE_INTERNAL_SECRET", secrets.token_urlsafe(32))
    try:
        client = ClientProcess()
        for frontends, isl in [(f, i) for f in cfg.frontends for i in cfg.isl]:
            worker = None
            if cfg.url is None:
                worker = BenchWorker(cfg, block_bytes, frontends)
                workers.append(worker)
                worker.wait_healthy()
            url = cfg.url or worker.url
            health = check_kv_backend(url)
            model = get_json(url.rstrip("/") + "/v1/models")["data"][0]
            target = Target(url, model["id"], layout, vocab_size, cfg.block_size)
            settle = 0.0 if frontends == 1 else 1.0   # their metrics reports arrive
            for mode in modes:   # unmeasured (first-request costs), but must succeed too
                warm = RunSpec(target, mode, isl, 4, 20, cfg.duration, cfg.timeout,
                               cfg.max_tokens, settle=settle)
                summarize_run(warm, client.run(warm))
            # The modes of one cell run back to back: the load of a shared machine drifts.
            runs += [_run(cfg, client, worker, target, mode, isl, c, frontends)
                     for c in cfg.concurrency for mode in modes]
            if worker is not None:
                worker.close()
    finally:
        if client is not None:
            client.close()
        for worker in workers:
            worker.close()
    return {"bench": "frontend", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": list(sys.argv), "versions": provenance.versions(),
            "machine": provenance.machine(),
            "load_average": {"start": load_start, "end": os.getloadavg()},
            "kv_backend": "none", "note": SKIP_NOTE,
            "worker": {"url": url, "started_here": bool(workers),
                       "started_per_isl": [w.url for w in workers],
                       "args": workers[0].args if workers else None, "health": health,
                       "model": target.model, "layout": layout,
                       "max_model_len": model.get("max_model_len")},
            "config": asdict(cfg), "runs": runs,
            # the targets are the front-end's per process: judged on the first count's runs
            "targets": evaluate_targets([r for r in runs if r["frontends"] == cfg.frontends[0]])}


def _run(cfg, client: ClientProcess, worker: BenchWorker | None, target: Target, mode: str,
         isl: int, c: int, frontends: int = 1) -> dict:
    spec = RunSpec(target, mode, isl, c, cfg.num_requests(c), cfg.duration, cfg.timeout,
                   cfg.max_tokens, cfg.ramp_up, cfg.think_time, cfg.min_duration,
                   settle=0.0 if frontends == 1 else 1.0)
    engine_cpu = worker.engine_cpu_seconds() if worker else None
    out = client.run(spec)
    if engine_cpu is not None:
        engine_cpu = worker.engine_cpu_seconds() - engine_cpu
    row = summarize_run(spec, out, engine_cpu)
    row["frontends"] = frontends
    if cfg.progress:
        g = row["gen_preprocessing_ms"]
        print(f"{frontends} fe {mode:>8} ISL {isl:>6} c {c:>4}: {row['completed']:>4} ok in "
              f"{row['duration_s']:.1f} s, {row['server_cpu_per_request_us']:.0f} us CPU/req, "
              f"gen_preprocessing p50 {format_ms(g['p50_ms'])} p99 {format_ms(g['p99_ms'])} ms",
              file=sys.stderr, flush=True)
    return row


# -- command line -----------------------------------------------------------------------------
def _ints(text: str) -> tuple[int, ...]:
    """'1k,32k,500' -> (1024, 32768, 500)"""
    out = []
    for item in filter(None, (t.strip().lower() for t in text.split(","))):
        out.append(int(item[:-1]) * 1024 if item.endswith("k") else int(item))
    return tuple(out)


def add_arguments(p) -> None:
    p.add_argument("--modes", default=",".join(MODES), help="token relay modes to compare")
    p.add_argument("--isl", type=_ints, default=None, help="prompt lengths (default 1k,8k,32k,128k)")
    p.add_argument("--concurrency", type=_ints, default=None, help="default 64,256,1024")
    p.add_argument("--requests", type=int, default=None,
                   help="per run (default max(4*concurrency, 1000))")
    p.add_argument("--duration", type=float, default=20.0,
                   help="seconds per run at most; requests in flight finish")
    p.add_argument("--min-duration", type=float, default=2.0,
                   help="seconds per run at least: a run that finishes its --requests sooner "
                        "keeps sending, so CPU per request is not read off a tenth of a second")
    p.add_argument("--quick", action="store_true",
                   help="a small grid (ISL 1k,32k; concurrency 64,256) unless --isl/--concurrency")
    p.add_argument("--url", default=None, help="an existing worker started with "
                   "--kv-backend none (default: start a tiny-random GEN worker)")
    p.add_argument("--max-tokens", type=int, default=1,
                   help="tokens each request generates: 1 makes every request pure front-end "
                        "work; more keeps `concurrency` requests decoding on the worker, as a "
                        "loaded GEN holds them, while new ones arrive as others finish")
    p.add_argument("--ramp-up", type=float, default=0.0,
                   help="seconds over which each run's connections send their first requests "
                        "(default all at once); with --max-tokens, about a request's lifetime")
    p.add_argument("--think-time", type=float, default=0.0,
                   help="mean seconds (exponentially distributed) each connection waits after "
                        "an answer before its next request, like a user reading it (default "
                        "0: a closed loop); spreads the arrivals of a held load out")
    p.add_argument("--api-server-counts", type=_ints, default=(1,),
                   help="front-end processes of the started worker (`serve "
                        "--api-server-count`), e.g. 1,2,4: the grid runs for each in turn")
    p.add_argument("--block-size", type=int, default=FrontendBenchConfig.block_size,
                   help="of the started worker (default: %(default)s)")
    p.add_argument("--kv-cache-gib", type=float, default=FrontendBenchConfig.kv_cache_gib,
                   help="KV pool of the started worker (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--json", default=None, help="default: bench-results/frontend-<time>.json")
    p.add_argument("--plot", default=None, help="default: the --json path with .png")
    p.add_argument("--no-progress", action="store_true")


def config_from_args(args) -> FrontendBenchConfig:
    return FrontendBenchConfig(
        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
        isl=args.isl or (QUICK_ISL if args.quick else DEFAULT_ISL),
        concurrency=args.concurrency or (QUICK_CONCURRENCY if args.quick else DEFAULT_CONCURRENCY),
        requests=args.requests, duration=args.duration, min_duration=args.min_duration,
        url=args.url, max_tokens=args.max_tokens,
        ramp_up=args.ramp_up, think_time=args.think_time,
        block_size=args.block_size, kv_cache_gib=args.kv_cache_gib, timeout=args.timeout,
        progress=not args.no_progress, frontends=args.api_server_counts)


def run(args) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"splitserve bench frontend: {exc}") from None
    try:
        result = benchmark(cfg)
    except BenchError as exc:
        raise SystemExit(f"splitserve bench frontend: {exc}") from None
    path = args.json or os.path.join("bench-results",
                                     f"frontend-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    result["plot"] = plot(result["runs"], args.plot or os.path.splitext(path)[0] + ".png")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"GEN front-end per token relay mode ({SKIP_NOTE})")
    print(format_table(result["runs"]))
    print(format_targets(result["targets"]))
    print(f"results: {path}\nplot: {result['plot']}")
    return 0
