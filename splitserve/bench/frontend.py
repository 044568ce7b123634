"""`splitserve bench frontend`: what the GEN front-end costs per token relay mode, against
prompt length (ISL) and concurrency.

One GEN worker (started here, or given with --url) runs with --bench-skip-kv-pull: a
generation_only request gets its blocks, "pulls" nothing, takes its first token from the
request (max_tokens 1) and frees its blocks at once. What is left to measure is the
front-end's event loop: reading the body, decoding the relayed prompt (a JSON int list,
base64 int32, or only its length), checking it and handing it to the engine.

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

import asyncio
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass

import aiohttp
import msgspec
import numpy as np

from splitserve.bench.metrics import latency_stats, server_deltas
from splitserve.server.metrics import parse_prometheus

MODES = ("list", "b64", "metadata")
DEFAULT_ISL = (1024, 8192, 32768, 131072)
DEFAULT_CONCURRENCY = (64, 256, 1024)
QUICK_ISL, QUICK_CONCURRENCY = (1024, 32768), (64, 256)
SKIP_NOTE = ("the KV pull was skipped (--bench-skip-kv-pull): generation_only requests decode "
             "from stale blocks, so their output is garbage; only the front-end is measured")
FIRST_TOKEN = 42                       # first_gen_tokens: any id of the vocabulary
_MARK = b"@CTX_REQUEST_ID@"            # where each request's unique ctx_request_id goes
GEN_PRE = "splitserve_gen_preprocessing_seconds"
QUEUE = "splitserve_request_queue_time_seconds"


class BenchError(RuntimeError):
    pass


@dataclass(frozen=True)
class FrontendBenchConfig:
    modes: tuple[str, ...] = MODES
    isl: tuple[int, ...] = DEFAULT_ISL
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    requests: int | None = None        # per run; None: max(2 * concurrency, 200)
    duration: float = 20.0             # seconds per run at most; requests in flight finish
    url: str | None = None             # an existing worker; None: start one
    block_size: int = 16
    kv_cache_gib: float = 2.0          # the started worker's KV pool
    timeout: float = 120.0             # seconds per request
    progress: bool = True

    def __post_init__(self):
        bad = [m for m in self.modes if m not in MODES]
        _require(self.modes and not bad, f"--modes takes {', '.join(MODES)}; got {bad or 'none'}")
        _require(self.isl and min(self.isl) >= 1, "--isl values must be >= 1")
        _require(self.concurrency and min(self.concurrency) >= 1, "--concurrency values must be >= 1")
        _require(self.requests is None or self.requests >= 1, "--requests must be >= 1")
        _require(self.duration > 0 and self.timeout > 0, "--duration and --timeout must be > 0")

    def num_requests(self, concurrency: int) -> int:
        return self.requests or max(2 * concurrency, 200)


def _require(ok, message: str) -> None:
    if not ok:
        raise ValueError(message)


# -- the worker -------------------------------------------------------------------------------
class Target(msgspec.Struct, frozen=True):
    """What the client needs to know about the worker to build valid requests."""
    url: str
    model: str
    layout: str            # kv.base.layout_fingerprint() of the worker's engine
    vocab_size: int


def tiny_layout(block_size: int) -> tuple[str, int, int]:
    """(layout fingerprint, vocab size, KV bytes per block) of tiny-random in float32."""
    import torch

    from splitserve.kv.base import layout_fingerprint
    from splitserve.model.loader import load_model_source
    cfg = load_model_source("tiny-random").config
    return (layout_fingerprint(cfg, torch.float32, block_size), cfg.vocab_size,
            block_size * cfg.kv_bytes_per_token(4))


class BenchWorker:
    """`splitserve serve` as a GEN worker with --bench-skip-kv-pull in a subprocess; close()
    stops it and waits (the worker stops its own engine process)."""

    def __init__(self, cfg: FrontendBenchConfig, block_bytes: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        # 2 GiB by default: 262144 blocks, 32 prompts of 128k. With max_tokens 1 a request
        # holds its blocks from the engine step that allocates them to the next, which frees
        # them, so the pool bounds how many are admitted per step, not per second: the
        # engine's bookkeeping costs about 1 us per block either way (7 ms per 128k prompt
        # at block size 16). Waits for blocks show in the queue column.
        num_blocks = int(cfg.kv_cache_gib * (1 << 30)) // block_bytes
        # No prefix caching: hashing a list/b64 prompt's blocks is engine work that would
        # compete with the front-end for the same cores and blur the comparison.
        self.args = ["--model", "tiny-random", "--dtype", "float32", "--role", "gen",
                     "--bench-skip-kv-pull", "--port", str(port), "--block-size",
                     str(cfg.block_size), "--num-blocks", str(num_blocks), "--max-num-seqs",
                     str(max(cfg.concurrency)), "--no-prefix-caching"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", "--log-level", "WARNING", "serve", *self.args],
            env=dict(os.environ, SPLITSERVE_NUM_THREADS="1"))

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"the worker exited with code {self.proc.returncode}")
            if _get_json(self.url + "/health", quiet=True) is not None:
                return
            time.sleep(0.2)
        raise BenchError(f"the worker at {self.url} did not become healthy in {timeout:.0f} s")

    def engine_cpu_seconds(self) -> float | None:
        """CPU time of the worker's child processes (its engine core), from /proc."""
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                return sum(_cpu_seconds(int(pid)) for pid in f.read().split())
        except OSError:
            return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads) from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()   # the name may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _get_json(url: str, quiet: bool = False) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())
    except (OSError, ValueError) as exc:
        if quiet:
            return None
        raise BenchError(f"GET {url} failed: {exc}") from None


def check_skip_flag(url: str) -> dict:
    """/health of a worker we did not start; refuse it unless it skips KV pulls."""
    health = _get_json(url.rstrip("/") + "/health")
    if health.get("bench_skip_kv_pull") is not True:
        raise BenchError(
            f"refusing {url}: its /health does not report bench_skip_kv_pull: true. The "
            "benchmark's generation_only requests carry a KV handle that points nowhere "
            "(tcp://127.0.0.1:1), so a worker that really pulls KV fails every one of them; "
            "start it with `splitserve serve ... --bench-skip-kv-pull`, or leave out --url and "
            "let this command start one")
    return health


# -- the client process -----------------------------------------------------------------------
class RunSpec(msgspec.Struct, frozen=True):
    target: Target
    mode: str
    isl: int
    concurrency: int
    num_requests: int
    duration: float
    timeout: float


def body_parts(target: Target, mode: str, isl: int) -> list[bytes]:
    """A generation_only /v1/completions body split around its ctx_request_id (in the
    params and in the KV handle), so each request gets a unique id by a join."""
    ids = np.random.default_rng(isl).integers(0, target.vocab_size, isl, dtype=np.int32)
    rid = _MARK.decode()
    dp = {"request_type": "generation_only", "ctx_request_id": rid,
          "first_gen_tokens": [FIRST_TOKEN], "prompt_len": isl,
          "kv_handle": {"backend": "tcp", "endpoint": "tcp://127.0.0.1:1", "ctx_request_id": rid,
                        "layout": target.layout, "num_tokens": isl}}
    if mode == "list":
        dp["prompt_token_ids"] = ids.tolist()
    elif mode == "b64":
        import pybase64
        dp["prompt_token_ids_b64"] = pybase64.b64encode(ids.astype("<i4").tobytes()).decode()
    body = {"model": target.model, "prompt": "x", "max_tokens": 1, "temperature": 0.0,
            "stream": False, "disaggregated_params": dp}
    return msgspec.json.encode(body).split(_MARK)


class _Usage(msgspec.Struct):
    prompt_tokens: int


class _Answer(msgspec.Struct):
    usage: _Usage


_ANSWER = msgspec.json.Decoder(_Answer)


async def _open_connections(http: aiohttp.ClientSession, url: str, n: int) -> None:
    """n keep-alive connections, opened by concurrent GET /health before the measurement."""
    async def one():
        async with http.get(url + "/health") as resp:
            await resp.read()
    await asyncio.gather(*(one() for _ in range(n)))


async def drive(spec: RunSpec, parts: list[bytes]) -> dict:
    """One run: warm connections, /metrics, the requests at fixed concurrency, /metrics."""
    url = spec.target.url.rstrip("/")
    connector = aiohttp.TCPConnector(limit=spec.concurrency, limit_per_host=spec.concurrency)
    timeout = aiohttp.ClientTimeout(total=spec.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        await _open_connections(http, url, spec.concurrency)
        before = await _scrape(http, url)
        latencies, failures = [], []
        todo = iter(range(spec.num_requests))    # shared: each index is taken once
        deadline = time.monotonic() + spec.duration

        async def sender():
            for i in todo:
                if time.monotonic() > deadline:
                    return
                rid = b"bench-%d-%d" % (os.getpid(), i)
                await _send(http, url, rid.join(parts), spec.isl, latencies, failures)
        start, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(sender() for _ in range(spec.concurrency)))
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        after = await _scrape(http, url)
    return {"latencies_s": latencies, "failures": failures[:5], "num_failed": len(failures),
            "duration_s": elapsed, "client_cpu_s": cpu, "body_bytes": len(b"bench-0-0".join(parts)),
            "metrics_before": before, "metrics_after": after}


async def _send(http, url: str, body: bytes, isl: int, latencies: list, failures: list) -> None:
    t0 = time.perf_counter()
    headers = {"Content-Type": "application/json", "X-Sent-At": repr(time.time())}
    try:
        async with http.post(url + "/v1/completions", data=body, headers=headers) as resp:
            data = await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        failures.append(f"{type(exc).__name__}: {exc}")
        return
    elapsed = time.perf_counter() - t0
    if resp.status != 200:
        failures.append(f"HTTP {resp.status}: {data[:300].decode(errors='replace')}")
        return
    try:
        got = _ANSWER.decode(data).usage.prompt_tokens
    except msgspec.DecodeError as exc:
        got = f"an unreadable answer ({exc})"
    if got != isl:
        failures.append(f"usage.prompt_tokens is {got}, not the relayed {isl}")
        return
    latencies.append(elapsed)


async def _scrape(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/metrics") as resp:
        resp.raise_for_status()
        return await resp.text()


def _client_main(conn) -> None:
    """The client process: RunSpecs in, results out (msgpack over the pipe) until b""."""
    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    cached: dict[tuple[str, int], list[bytes]] = {}   # the bodies of one ISL at a time
    with asyncio.Runner(loop_factory=factory) as runner:
        while (raw := conn.recv_bytes()) != b"":
            spec = msgspec.msgpack.decode(raw, type=RunSpec)
            try:
                key = (spec.mode, spec.isl)
                if key not in cached:
                    cached = {k: v for k, v in cached.items() if k[1] == spec.isl}
                    cached[key] = body_parts(spec.target, spec.mode, spec.isl)
                out = runner.run(drive(spec, cached[key]))
            except Exception as exc:  # reported to the parent, which stops the benchmark
                out = {"error": f"{type(exc).__name__}: {exc}"}
            conn.send_bytes(msgspec.msgpack.encode(out))


class ClientProcess:
    """The load generator in its own process (spawned), so its CPU is apart from the
    benchmark's parent; the machine's cores are shared by client, front-end and engine."""

    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_client_main, args=(child,), name="bench-client", daemon=True)
        self.proc.start()
        child.close()

    def run(self, spec: RunSpec) -> dict:
        self.conn.send_bytes(msgspec.msgpack.encode(spec))
        try:
            out = msgspec.msgpack.decode(self.conn.recv_bytes())
        except EOFError:
            raise BenchError(f"the client process died (exit code {self.proc.exitcode})") from None
        if "error" in out:
            raise BenchError(f"the client failed: {out['error']}")
        return out

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send_bytes(b"")
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join()


# -- one run, from the worker's point of view -------------------------------------------------
def summarize_run(spec: RunSpec, out: dict, engine_cpu: float | None = None) -> dict:
    """The run's row; BenchError when any request failed or the worker miscounted.
    engine_cpu: CPU seconds of the engine process over the run, when known."""
    where = f"{spec.mode} ISL {spec.isl} concurrency {spec.concurrency}"
    if out["num_failed"]:
        raise BenchError(f"{where}: {out['num_failed']} requests failed, e.g. "
                         + " | ".join(out["failures"]))
    done = len(out["latencies_s"])
    server = server_deltas(parse_prometheus(out["metrics_before"]),
                           parse_prometheus(out["metrics_after"]))
    counters, hists = server["counters"], server["histograms"]
    relayed = counters.get(f'splitserve_token_relay_total{{mode="{spec.mode}"}}', 0)
    if done == 0 or relayed != done or hists[GEN_PRE]["count"] != done:
        raise BenchError(f"{where}: {done} answers, but the worker counted {relayed:g} "
                         f"{spec.mode} relays and {hists[GEN_PRE]['count']} admissions")
    cpu = counters["process_cpu_seconds_total"]
    return {"mode": spec.mode, "isl": spec.isl, "concurrency": spec.concurrency,
            "requests": spec.num_requests, "completed": done, "errors": 0,
            "truncated_by_duration": done < spec.num_requests, "duration_s": out["duration_s"],
            "request_throughput": done / out["duration_s"], "body_bytes": out["body_bytes"],
            "server_cpu_s": cpu, "server_cpu_per_request_us": 1e6 * cpu / done,
            "engine_cpu_per_request_us": None if engine_cpu is None else 1e6 * engine_cpu / done,
            "client_cpu_per_request_us": 1e6 * out["client_cpu_s"] / done,
            "gen_preprocessing_ms": _hist(hists[GEN_PRE]), "queue_ms": _hist(hists[QUEUE]),
            "client_latency_ms": latency_stats(out["latencies_s"])}


def _hist(h: dict) -> dict:
    return {k: h[k] for k in ("count", "mean_ms", "p50_ms", "p99_ms")}


# -- targets ----------------------------------------------------------------------------------
def _cell(runs: list[dict], mode: str, isl: int, c: int) -> dict | None:
    return next((r for r in runs if (r["mode"], r["isl"], r["concurrency"]) == (mode, isl, c)), None)


def _nearest(values, want: int) -> int:
    return want if want in values else max(values)


def _ratio_target(runs, name, num, den, isl_num, isl_den, bound) -> dict:
    """max over the grid's concurrencies of cpu/request (num at isl_num) / (den at isl_den)."""
    ratios = {}
    for c in sorted({r["concurrency"] for r in runs}):
        a, b = _cell(runs, num, isl_num, c), _cell(runs, den, isl_den, c)
        if a and b:
            ratios[c] = a["server_cpu_per_request_us"] / b["server_cpu_per_request_us"]
    worst = max(ratios.values()) if ratios else None
    return {"name": name, "bound": bound, "value": worst, "by_concurrency": ratios,
            "pass": None if worst is None else worst <= bound}


def evaluate_targets(runs: list[dict]) -> list[dict]:
    """The issue's targets, each at the grid's value nearest to the one it names."""
    isls = {r["isl"] for r in runs}
    mid, lo, hi = _nearest(isls, 32768), min(isls), _nearest(isls, 131072)
    c_hi = _nearest({r["concurrency"] for r in runs}, 1024)
    targets = [
        _ratio_target(runs, f"server CPU/request b64 / list at ISL {mid}", "b64", "list",
                      mid, mid, 1 / 5),
        _ratio_target(runs, f"server CPU/request metadata / list at ISL {mid}", "metadata",
                      "list", mid, mid, 1 / 20),
        _ratio_target(runs, f"server CPU/request metadata ISL {hi} / ISL {lo}", "metadata",
                      "metadata", hi, lo, 1.5)]
    p99 = {r["isl"]: r["gen_preprocessing_ms"]["p99_ms"] for r in runs
           if r["mode"] == "metadata" and r["concurrency"] == c_hi}
    worst = max(p99.values()) if p99 else None
    targets.append({"name": f"gen_preprocessing p99 (ms), metadata, concurrency {c_hi}",
                    "bound": 10.0, "value": worst, "by_isl": p99,
                    "pass": None if worst is None else worst <= 10.0})
    return targets


# -- report -----------------------------------------------------------------------------------
def format_table(runs: list[dict]) -> str:
    lines = ["CPU in us per request: fe = the worker's front-end (the measured cost), eng = its "
             "engine process, cli = the client; fe% = front-end CPU / wall time. Latencies in "
             "ms: pre = gen_preprocessing (X-Sent-At -> engine admission), queue = admission -> "
             "KV blocks (server percentiles interpolated in histogram buckets), lat = client. "
             "* = stopped by --duration",
             f"{'mode':<9}{'ISL':>7}{'conc':>6}{'ok':>6}{'req/s':>7}{'fe':>7}{'eng':>7}{'cli':>7}"
             f"{'fe%':>5}{'pre p50':>9}{'pre p99':>9}{'queue p99':>10}{'lat p50':>9}{'lat p99':>9}"
             f"{'KiB':>6}"]
    for r in runs:
        g, q, lat = r["gen_preprocessing_ms"], r["queue_ms"], r["client_latency_ms"]
        eng = r["engine_cpu_per_request_us"]
        ok = f"{r['completed']}{'*' if r['truncated_by_duration'] else ''}"
        queue = "<1" if (q["p99_ms"] or 0) <= 1.0 else _ms(q["p99_ms"])   # first bucket: 1 ms
        lines.append(f"{r['mode']:<9}{r['isl']:>7}{r['concurrency']:>6}{ok:>6}"
                     f"{r['request_throughput']:>7.0f}{r['server_cpu_per_request_us']:>7.0f}"
                     f"{'-' if eng is None else f'{eng:.0f}':>7}"
                     f"{r['client_cpu_per_request_us']:>7.0f}"
                     f"{100 * r['server_cpu_s'] / r['duration_s']:>5.0f}"
                     f"{_ms(g['p50_ms']):>9}{_ms(g['p99_ms']):>9}{queue:>10}"
                     f"{_ms(lat['p50']):>9}{_ms(lat['p99']):>9}{r['body_bytes'] / 1024:>6.0f}")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}" if v < 1 else f"{v:.1f}"


def format_targets(targets: list[dict]) -> str:
    lines = []
    for t in targets:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[t["pass"]]
        value = "not measured" if t["value"] is None else f"{t['value']:.3g}"
        detail = t.get("by_concurrency") or t.get("by_isl") or {}
        each = ", ".join(f"{k}: {v:.3g}" for k, v in detail.items())
        lines.append(f"{verdict}  {t['name']}: {value} (target <= {t['bound']:.3g}; {each})")
    return "\n".join(lines)


def plot(runs: list[dict], path: str) -> str:
    """gen_preprocessing p50 (solid) and p99 (dashed) against concurrency, log-log: one
    panel per ISL, one line per mode."""
    from splitserve.bench.plot import _pyplot
    plt = _pyplot()
    isls = sorted({r["isl"] for r in runs})
    fig, axes = plt.subplots(1, len(isls), figsize=(3.6 * len(isls) + 1, 4.2), sharey=True,
                             squeeze=False)
    for ax, isl in zip(axes[0], isls):
        for i, mode in enumerate(MODES):
            cells = sorted((r for r in runs if r["mode"] == mode and r["isl"] == isl),
                           key=lambda r: r["concurrency"])
            x = [r["concurrency"] for r in cells]
            for q, style in (("p50_ms", "-"), ("p99_ms", "--")):
                y = [r["gen_preprocessing_ms"][q] or np.nan for r in cells]
                ax.plot(x, y, style, marker="o", color=f"C{i}",
                        label=mode if cells and q == "p50_ms" else None)
        ticks = sorted({r["concurrency"] for r in runs})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ticks, [str(c) for c in ticks])
        ax.set(title=f"ISL {isl}", xlabel="concurrency")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("gen_preprocessing (ms)")
    axes[0][-1].legend(fontsize="small")
    fig.suptitle("GEN front-end: X-Sent-At -> engine admission, per token relay mode "
                 "(p50 solid, p99 dashed)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -- the benchmark ----------------------------------------------------------------------------
def benchmark(cfg: FrontendBenchConfig) -> dict:
    """Run the grid; the result document (runs, targets, worker, machine)."""
    layout, vocab_size, block_bytes = tiny_layout(cfg.block_size)
    load_start = os.getloadavg()   # the cores are shared with whatever else runs here
    worker = client = None
    try:
        if cfg.url is None:
            worker = BenchWorker(cfg, block_bytes)
            worker.wait_healthy()
        url = cfg.url or worker.url
        health = check_skip_flag(url)
        model = _get_json(url.rstrip("/") + "/v1/models")["data"][0]
        target = Target(url, model["id"], layout, vocab_size)
        client = ClientProcess()
        for mode in cfg.modes:   # unmeasured (first-request costs), but must succeed too
            warm = RunSpec(target, mode, min(cfg.isl), 4, 20, cfg.duration, cfg.timeout)
            summarize_run(warm, client.run(warm))
        # The modes of one cell run back to back: the load of a shared machine drifts.
        runs = [_run(cfg, client, worker, target, mode, isl, c)
                for isl in cfg.isl for c in cfg.concurrency for mode in cfg.modes]
    finally:
        if client is not None:
            client.close()
        if worker is not None:
            worker.close()
    from splitserve.bench.serve import _machine, _versions
    return {"bench": "frontend", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": list(sys.argv), "versions": _versions(), "machine": _machine(),
            "load_average": {"start": load_start, "end": os.getloadavg()},
            "bench_skip_kv_pull": True, "note": SKIP_NOTE,
            "worker": {"url": url, "started_here": worker is not None,
                       "args": worker.args if worker else None, "health": health,
                       "model": target.model, "layout": layout,
                       "max_model_len": model.get("max_model_len")},
            "config": asdict(cfg), "runs": runs, "targets": evaluate_targets(runs)}


def _run(cfg, client: ClientProcess, worker: BenchWorker | None, target: Target, mode: str,
         isl: int, c: int) -> dict:
    spec = RunSpec(target, mode, isl, c, cfg.num_requests(c), cfg.duration, cfg.timeout)
    engine_cpu = worker.engine_cpu_seconds() if worker else None
    out = client.run(spec)
    if engine_cpu is not None:
        engine_cpu = worker.engine_cpu_seconds() - engine_cpu
    row = summarize_run(spec, out, engine_cpu)
    if cfg.progress:
        g = row["gen_preprocessing_ms"]
        print(f"{mode:>8} ISL {isl:>6} c {c:>4}: {row['completed']:>4} ok in "
              f"{row['duration_s']:.1f} s, {row['server_cpu_per_request_us']:.0f} us CPU/req, "
              f"gen_preprocessing p50 {_ms(g['p50_ms'])} p99 {_ms(g['p99_ms'])} ms",
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
                   help="per run (default max(2*concurrency, 200))")
    p.add_argument("--duration", type=float, default=20.0,
                   help="seconds per run at most; requests in flight finish")
    p.add_argument("--quick", action="store_true",
                   help="a small grid (ISL 1k,32k; concurrency 64,256) unless --isl/--concurrency")
    p.add_argument("--url", default=None, help="an existing worker started with "
                   "--bench-skip-kv-pull (default: start a tiny-random GEN worker)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV pool of the started worker")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--json", default=None, help="default: bench-results/frontend-<time>.json")
    p.add_argument("--plot", default=None, help="default: the --json path with .png")
    p.add_argument("--no-progress", action="store_true")


def config_from_args(args) -> FrontendBenchConfig:
    return FrontendBenchConfig(
        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
        isl=args.isl or (QUICK_ISL if args.quick else DEFAULT_ISL),
        concurrency=args.concurrency or (QUICK_CONCURRENCY if args.quick else DEFAULT_CONCURRENCY),
        requests=args.requests, duration=args.duration, url=args.url,
        block_size=args.block_size, kv_cache_gib=args.kv_cache_gib, timeout=args.timeout,
        progress=not args.no_progress)


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
