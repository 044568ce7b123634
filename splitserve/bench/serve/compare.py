"""`splitserve bench serve --compare URL`: one workload against several OpenAI-compatible
servers, one table.

Every server gets the same prompts (the same seed), the same load and the same streaming
settings. Runs go level by level, and inside a level server by server, so slow drift of a
shared machine spreads over every server instead of landing on the last one. Each level has
its own prompts (seed + 2 * level index), so a server's prefix cache never holds a later
level's prompts; warm-up requests (--warmup) run once per server, before its first level.
Each server is asked its model name (GET /v1/models) before anything runs: a server that is
down or unreachable stops the comparison before it starts.

Before each run the comparison waits (up to --settle seconds) for the machine to go quiet:
a server that has just served may keep its CPU busy for a while (CPU vLLM's engine spins for
about a second after its last request), and on a small machine shared with the load generator
that time would come out of the next server's run. Each run records how long it waited and
how busy the machine still was (`settle`); the table names runs that started on a busy machine.

Every row holds the server's output tok/s, TTFT p50/p99 and ITL avg/p50/p99 at one load,
and `ratios`: each of those divided by the first server's value at the same load (so the
first server reads 1.0 everywhere; for throughput above 1 is faster, for latencies below 1).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import urllib.parse
from dataclasses import dataclass

import aiohttp

from splitserve.bench import provenance
from splitserve.bench.serve.main import ServeBenchConfig, benchmark
from splitserve.bench.serve.client import served_model
from splitserve.bench.report.machine import machine_cpu_s

QUIET_CORES = 0.25      # the machine counts as quiet below this many busy cores

# (row key, label in the table, path in a run's metrics)
COLUMNS = (
    ("output_throughput", "out tok/s", ("output_throughput",)),
    ("ttft_p50_ms", "TTFT p50", ("ttft_ms", "p50")),
    ("ttft_p99_ms", "TTFT p99", ("ttft_ms", "p99")),
    ("itl_mean_ms", "ITL avg", ("itl_ms", "mean")),
    ("itl_p50_ms", "ITL p50", ("itl_ms", "p50")),
    ("itl_p99_ms", "ITL p99", ("itl_ms", "p99")),
)


@dataclass(frozen=True)
class Server:
    name: str
    url: str


def _default_name(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc or url


def _named(item: str) -> tuple[str | None, str]:
    """'NAME=URL' -> (NAME, URL); a bare URL -> (None, URL)."""
    name, sep, url = item.partition("=")
    if sep and "://" in url and not any(c in name for c in ":/"):
        return name.strip(), url.strip()
    return None, item.strip()


def servers_from_args(url: str, name: str | None, compares: list[str] | None,
                      compare_names: list[str] | None) -> list[Server]:
    """The target first, then every --compare server in order; ValueError on bad names."""
    compares, compare_names = compares or [], compare_names or []
    if len(compare_names) > len(compares):
        raise ValueError(f"{len(compare_names)} --compare-name for {len(compares)} --compare")
    servers = [Server(name or _default_name(url), url)]
    for i, item in enumerate(compares):
        own, target = _named(item)
        given = compare_names[i] if i < len(compare_names) else None
        if own is not None and given is not None:
            raise ValueError(f"--compare {item!r} is named twice (NAME=URL and --compare-name)")
        servers.append(Server(own or given or _default_name(target), target))
    names = [s.name for s in servers]
    if len(set(names)) != len(names):
        raise ValueError(f"server names must differ, got {names}; name them with "
                         "--name, --compare-name or --compare NAME=URL")
    return servers


# -- the runs ---------------------------------------------------------------------------------
async def _models(cfg: ServeBenchConfig, servers: list[Server]) -> list[str]:
    """The model name each server expects: --model for the target, else its /v1/models."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    async with aiohttp.ClientSession(headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=60)) as http:
        return [cfg.model if i == 0 and cfg.model else await served_model(http, s.url)
                for i, s in enumerate(servers)]


def _run_config(cfg: ServeBenchConfig, server: Server, model: str, level: int | None,
                index: int) -> ServeBenchConfig:
    load = f"c{level}" if level is not None else f"r{cfg.request_rate:g}"
    return dataclasses.replace(
        cfg, url=server.url, model=model, concurrency=level, label=f"{server.name}-{load}",
        workload=dataclasses.replace(cfg.workload, seed=cfg.workload.seed + 2 * index),
        warmup=cfg.warmup if index == 0 else 0)


async def settle(limit_s: float, window_s: float = 0.5) -> dict:
    """Waits until every process together keeps fewer than QUIET_CORES cores busy over one
    window_s window, or limit_s has passed. -> {"waited_s", "busy_cores"}: the time waited
    and the busy cores over the last window (None without /proc/stat, or with limit_s 0)."""
    t0 = time.monotonic()
    busy = None
    while limit_s > 0:
        try:
            c0, w0 = machine_cpu_s(), time.monotonic()
            await asyncio.sleep(window_s)
            busy = (machine_cpu_s() - c0) / (time.monotonic() - w0)
        except OSError:
            break
        if busy < QUIET_CORES or time.monotonic() - t0 >= limit_s:
            break
    return {"waited_s": round(time.monotonic() - t0, 2),
            "busy_cores": None if busy is None else round(busy, 2)}


async def compare(cfg: ServeBenchConfig, servers: list[Server],
                  levels: list[int | None]) -> dict:
    """Every server at every level (closed-loop concurrency, or None: cfg's open loop)."""
    models = await _models(cfg, servers)
    runs = []
    for index, level in enumerate(levels):
        for server, model in zip(servers, models):
            quiet = await settle(cfg.settle)
            runs.append({**await benchmark(_run_config(cfg, server, model, level, index)),
                         "settle": quiet})
    return {
        "label": cfg.label, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": list(cfg.command), "versions": provenance.versions(),
        "machine": provenance.machine(),
        "servers": [{"name": s.name, "url": s.url, "model": m} for s, m in zip(servers, models)],
        "load": {"concurrency": levels if levels != [None] else None,
                 "request_rate": cfg.request_rate, "burstiness": cfg.burstiness,
                 "num_requests": cfg.num_requests, "duration": cfg.duration,
                 "warmup": cfg.warmup, "timeout": cfg.timeout, "stream": cfg.stream,
                 "settle": cfg.settle},
        "workload": dataclasses.asdict(cfg.workload),
        "rows": rows(runs, [s.name for s in servers]),
        "runs": runs,
    }


def _value(metrics: dict, path: tuple[str, ...]) -> float | None:
    for key in path:
        metrics = metrics[key]
    return metrics


def rows(runs: list[dict], names: list[str]) -> list[dict]:
    """One row per run (runs ordered level by level, servers in `names` order)."""
    out = []
    for i, run in enumerate(runs):
        m, first = run["metrics"], runs[i - i % len(names)]["metrics"]
        row = {"server": names[i % len(names)], "url": run["target"]["url"],
               "model": run["target"]["model"], "concurrency": run["load"]["concurrency"],
               "request_rate": run["load"]["request_rate"], "completed": m["completed"],
               "failed": m["failed"], "errors": m["errors"], "settle": run.get("settle")}
        ratios = {}
        for key, _, path in COLUMNS:
            row[key], base = _value(m, path), _value(first, path)
            ratios[key] = row[key] / base if row[key] is not None and base else None
        out.append({**row, "ratios": ratios})
    return out


# -- the table --------------------------------------------------------------------------------
def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _load_cell(row: dict) -> str:
    return (f"c={row['concurrency']}" if row["concurrency"] is not None
            else f"r={row['request_rate']:g}")


def format_table(doc: dict) -> str:
    """The comparison as text: one line per server and load; 'x first' is the output tok/s
    ratio to the first server at the same load, 'ITL x' the ITL avg ratio."""
    wl, load = doc["workload"], doc["load"]
    head = (f"== {doc['label']}: workload {wl['kind']} ({wl['endpoint']}, input "
            f"{wl['input_len']}, output {wl['output_len']}, seed {wl['seed']}), "
            f"{'stream' if load['stream'] else 'no stream'}, "
            f"{load['num_requests'] or '-'} requests / {load['duration'] or '-'} s per run")
    width = max(len(r["server"]) for r in doc["rows"]) + 2
    header = (f"{'server':<{width}}{'load':>7}{'ok/fail':>9}"
              + "".join(f"{label:>11}" for _, label, _ in COLUMNS) + f"{'x first':>9}{'ITL x':>8}")
    lines = [head, header + "   (latencies in ms)"]
    for r in doc["rows"]:
        load_cell = _load_cell(r)
        cells = "".join(f"{_cell(r[key], '.1f' if key == 'output_throughput' else '.2f'):>11}"
                        for key, _, _ in COLUMNS)
        lines.append(f"{r['server']:<{width}}{load_cell:>7}{r['completed']:>5}/{r['failed']:<3}"
                     f"{cells}{_cell(r['ratios']['output_throughput'], '.2f'):>9}"
                     f"{_cell(r['ratios']['itl_mean_ms'], '.2f'):>8}")
    lines += [f"{s['name']}: {s['url']} (model {s['model']})" for s in doc["servers"]]
    errors = [f"{r['server']} {k} {v}" for r in doc["rows"] for k, v in sorted(r["errors"].items())]
    busy = [f"{r['server']} {_load_cell(r)} ({r['settle']['busy_cores']:.2f} cores after "
            f"{r['settle']['waited_s']:.1f} s)" for r in doc["rows"]
            if (r.get("settle") or {}).get("busy_cores") is not None
            and r["settle"]["busy_cores"] >= QUIET_CORES]
    if busy:
        lines.append("started on a busy machine: " + ", ".join(busy))
    return "\n".join(lines + [f"errors: {', '.join(errors) or 'none'}"])

