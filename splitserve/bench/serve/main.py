"""`splitserve bench serve`: an async load generator against any OpenAI-compatible server.

Load is closed-loop (--concurrency N workers, each sending its next request when the last one
ends) or open-loop (--request-rate R arrivals per second: Poisson when --burstiness is 1,
gamma-distributed gaps with shape=burstiness otherwise; a multi-turn conversation is one
arrival). Warm-up requests run first and are not measured. The run ends when --num-requests
have been sent or --duration has passed, whichever comes first; requests in flight finish.
Metric definitions: `splitserve bench serve --explain` (splitserve/bench/metrics.py).

The result is one JSON document: label, timestamp, command, versions, machine, target,
load, workload, metrics, metrics_by_class, errors, server, requests. With several
--concurrency levels or any --compare server, the same workload runs against every server
at every level and the result is one comparison table (splitserve/bench/serve/compare.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import msgspec

from splitserve.bench import metrics as M
from splitserve.bench import provenance
from splitserve.bench.serve import workloads
from splitserve.bench.serve.client import ServeClient, scrape_metrics, served_model
from splitserve.bench.serve.workloads import Budget, Load, WorkloadConfig, sessions


@dataclass(frozen=True)
class ServeBenchConfig:
    url: str = "http://127.0.0.1:8000"
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    stream: bool = True
    model: str | None = None                # None: the first model of /v1/models
    concurrency: int | None = None          # closed loop (1 when neither is given)
    request_rate: float | None = None       # open loop, requests (conversations) per second
    burstiness: float = 1.0
    num_requests: int | None = 100
    duration: float | None = None           # seconds
    warmup: int = 0
    slo: dict[str, float] = field(default_factory=dict)
    timeout: float = 600.0                  # seconds per request
    api_key: str | None = field(default=None, repr=False)   # sent as Authorization: Bearer
    label: str = "run"
    progress: bool = True
    command: tuple[str, ...] = ()
    settle: float = 10.0                    # comparisons: max seconds to wait for a quiet machine

    def __post_init__(self):
        if self.concurrency is not None and self.request_rate is not None:
            raise ValueError("give one of --concurrency and --request-rate, not both")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"--request-rate must be positive, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be positive, got {self.burstiness}")
        if self.num_requests is None and self.duration is None:
            raise ValueError("give --num-requests and/or --duration")
        if (self.num_requests or 1) < 1 or (self.duration or 1) <= 0 or self.warmup < 0:
            raise ValueError("--num-requests and --duration must be positive, --warmup >= 0")
        if not self.settle >= 0:
            raise ValueError(f"--settle must be >= 0 seconds, got {self.settle}")
        if not self.stream and set(self.slo) & {"ttft", "tpot", "itl"}:
            raise ValueError("ttft, tpot and itl SLOs need a streaming run (drop --no-stream)")

    @property
    def workers(self) -> int | None:
        """Closed-loop concurrency; None for an open-loop run."""
        return None if self.request_rate is not None else (self.concurrency or 1)


# -- a run ------------------------------------------------------------------------------------
async def _measure(client: ServeClient, cfg: ServeBenchConfig) -> Load:
    wl = cfg.workload
    load = Load(client.send, Budget(cfg.num_requests, cfg.duration))
    progress = asyncio.create_task(load.progress(cfg.num_requests)) if cfg.progress else None
    try:
        if cfg.workers is not None:
            await load.closed_loop(sessions(wl), cfg.workers)
        else:
            await load.open_loop(sessions(wl), cfg.request_rate, cfg.burstiness, wl.seed)
    finally:
        if progress is not None:
            progress.cancel()
            await asyncio.gather(progress, return_exceptions=True)
    return load


async def benchmark(cfg: ServeBenchConfig) -> dict:
    """Run the benchmark against cfg.url; the result document (see the module docstring)."""
    # Open loop: no connection cap, or arrivals would queue in the client and inflate TTFT.
    limit = cfg.workers or 0
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    async with aiohttp.ClientSession(connector=connector, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=cfg.timeout)) as http:
        model = cfg.model or await served_model(http, cfg.url)
        client = ServeClient(http, cfg.url, cfg.workload.endpoint, model, cfg.stream,
                             cfg.workload.response_format)
        if cfg.warmup:
            warm_cfg = dataclasses.replace(cfg.workload, seed=cfg.workload.seed + 1)
            await Load(client.send, Budget(cfg.warmup, None)).closed_loop(
                sessions(warm_cfg), min(cfg.warmup, cfg.workers or 1))
        before = await scrape_metrics(http, cfg.url)
        load = await _measure(client, cfg)
        # The server records a request's metrics before it writes [DONE]: nothing is missed.
        after = await scrape_metrics(http, cfg.url) if isinstance(before, dict) else before
    return _result(cfg, model, load, before, after)


def _result(cfg: ServeBenchConfig, model: str, load: Load, before, after) -> dict:
    records, slo, duration = load.records, cfg.slo, load.duration
    summary = M.summarize(records, duration, slo)
    server = ({"available": True, **M.server_deltas(before, after)}
              if isinstance(before, dict) and isinstance(after, dict)
              else {"available": False, "reason": after if isinstance(after, str) else before})
    return {
        "label": cfg.label, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": list(cfg.command), "versions": provenance.versions(),
        "machine": provenance.machine(),
        "target": {"url": cfg.url, "endpoint": cfg.workload.endpoint, "model": model,
                   "stream": cfg.stream},
        "load": {"concurrency": cfg.workers, "request_rate": cfg.request_rate,
                 "burstiness": cfg.burstiness, "num_requests": cfg.num_requests,
                 "duration": cfg.duration, "warmup": cfg.warmup, "timeout": cfg.timeout},
        "workload": dataclasses.asdict(cfg.workload),
        "metrics": summary, "metrics_by_class": M.summarize_by_class(records, duration, slo),
        "errors": summary["errors"], "server": server,
        "requests": msgspec.to_builtins(records),
    }


# -- command line -----------------------------------------------------------------------------
def _levels(text: str) -> tuple[int, ...]:
    """'1,8' -> (1, 8): the closed-loop concurrency levels to run, in order."""
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N,M,..., got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be >= 1, got {text!r}")
    return levels


def add_arguments(p) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--name", default=None, help="the --url server's name in a comparison "
                                                "(default: its host:port)")
    p.add_argument("--compare", action="append", default=None, metavar="[NAME=]URL",
                   help="run the same workload against this server too, one table "
                        "(repeatable; splitserve/bench/serve/compare.py)")
    p.add_argument("--compare-name", action="append", default=None, metavar="NAME",
                   help="the name of the i-th --compare server (default: its host:port)")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer to every "
                   "server (default: $OPENAI_API_KEY); never written to the results")
    p.add_argument("--endpoint", choices=["completions", "chat"], default=None,
                   help="default: chat for multi-turn and mixed, completions otherwise")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--model", default=None, help="the --url server's model (default: the "
                   "first of its /v1/models; --compare servers are always asked theirs)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=_levels, default=None,
                      help="closed loop (default 1); N,M,... runs each level in turn")
    load.add_argument("--request-rate", type=float, default=None, help="open loop, per second")
    p.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson; <1 burstier")
    p.add_argument("--num-requests", type=int, default=None,
                   help="default 100 without --duration (per level and server)")
    p.add_argument("--duration", type=float, default=None, help="seconds")
    p.add_argument("--warmup", type=int, default=0, help="requests sent first, not measured")
    slo = p.add_mutually_exclusive_group()
    slo.add_argument("--slo", default=None, help="goodput bounds in seconds: ttft=0.5,tpot=0.05")
    slo.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                     help="goodput bounds as vLLM takes them, in milliseconds: ttft:500 "
                          "tpot:50 (keys ttft, tpot, itl: every gap, e2el)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--settle", type=float, default=10.0, metavar="SECONDS",
                   help="in a comparison, before each run wait up to this long for the machine "
                        "to go quiet (a server that just served may keep its CPU busy); 0: "
                        "never wait")
    workloads.add_arguments(p)
    p.add_argument("--json", "--out", dest="json", default=None,
                   help="default: bench-results/<label>-<time>.json")
    p.add_argument("--label", default=None, help="default: <workload>-c<N> or <workload>-r<R>")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--explain", action="store_true", help="print the metric definitions")


def _redacted(argv: list[str]) -> tuple[str, ...]:
    """The command line as recorded in the results: the API key's value masked."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg.startswith("--api-key="):
            out[i] = "--api-key=***"
        elif arg == "--api-key" and i + 1 < len(out):
            out[i + 1] = "***"
    return tuple(out)


def _label(args, kind: str) -> str:
    if args.label:
        return args.label
    if args.request_rate is not None:
        load = f"r{args.request_rate:g}"
    else:
        load = "c" + "-".join(map(str, args.concurrency or (1,)))
    return f"{kind}-{load}" + ("-compare" if args.compare else "")


def config_from_args(args) -> ServeBenchConfig:
    num = 100 if args.num_requests is None and args.duration is None else args.num_requests
    wl = workloads.config_from_args(args)
    return ServeBenchConfig(
        url=args.url, workload=wl, stream=args.stream, model=args.model,
        concurrency=args.concurrency[0] if args.concurrency else None,
        request_rate=args.request_rate, burstiness=args.burstiness,
        num_requests=num, duration=args.duration, warmup=args.warmup,
        slo=M.parse_slo(args.slo) if args.goodput is None else M.parse_goodput(args.goodput),
        timeout=args.timeout, label=_label(args, wl.kind),
        progress=not args.no_progress, command=_redacted(sys.argv), settle=args.settle,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None)


def run(args) -> dict:
    if args.explain:
        print(M.__doc__)
        return {}
    from splitserve.bench.serve import compare      # it builds on this module
    try:
        cfg = config_from_args(args)
        servers = compare.servers_from_args(args.url, args.name, args.compare,
                                            args.compare_name)
    except ValueError as exc:
        raise SystemExit(f"splitserve bench serve: {exc}") from None
    levels = list(args.concurrency or [None if args.request_rate is not None else 1])
    sweep = len(servers) > 1 or len(levels) > 1
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        try:
            result = runner.run(compare.compare(cfg, servers, levels) if sweep
                                else benchmark(cfg))
        except RuntimeError as exc:     # no model name to send
            raise SystemExit(f"splitserve bench serve: {exc}") from None
    path = args.json or os.path.join("bench-results",
                                     f"{cfg.label}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(compare.format_table(result) if sweep else M.format_table(result))
    print(f"results: {path}")
    return result
