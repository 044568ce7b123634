"""The load generator of `splitserve bench frontend`: pre-built generation_only bodies sent
at fixed concurrency over keep-alive connections (splitserve/httpd/client.py: X-Sent-At is
stamped as the request is written), from a process of its own."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import time

import aiohttp
import msgspec
import numpy as np

from splitserve.bench.frontend.config import BenchError
from splitserve.httpd.client import HTTPConnection
from splitserve.protocol.block_hashes import digest_of_tokens

FIRST_TOKEN = 42                       # first_gen_tokens: any id of the vocabulary
_MARK = b"@CTX_REQUEST_ID@"            # where each request's unique ctx_request_id goes


class Target(msgspec.Struct, frozen=True):
    """What the client needs to know about the worker to build valid requests."""
    url: str
    model: str
    layout: str            # kv.base.layout_fingerprint() of the worker's engine
    vocab_size: int
    block_size: int = 16   # the worker's: a relayed prompt's digest is taken in its blocks


class RunSpec(msgspec.Struct, frozen=True):
    target: Target
    mode: str
    isl: int
    concurrency: int
    num_requests: int
    duration: float
    timeout: float
    max_tokens: int = 1
    ramp_up: float = 0.0     # seconds over which the connections send their first requests
    think_time: float = 0.0  # mean seconds (exponential) a connection waits after an answer
    min_duration: float = 0.0  # seconds the run lasts at least: it sends past num_requests
    # seconds to wait before each /metrics scrape: a worker of several front-ends sums
    # their reports, which are up to half a second old (server/frontends.py)
    settle: float = 0.0


def body_parts(target: Target, mode: str, isl: int, max_tokens: int = 1) -> list[bytes]:
    """A generation_only /v1/completions body split around its ctx_request_id (in the
    params and in the KV handle), so each request gets a unique id by a join. max_tokens > 1
    (with ignore_eos) keeps each request decoding on the worker that long."""
    ids = np.random.default_rng(isl).integers(0, target.vocab_size, isl, dtype=np.int32)
    rid = _MARK.decode()
    dp = {"request_type": "generation_only", "ctx_request_id": rid,
          "first_gen_tokens": [FIRST_TOKEN], "prompt_len": isl,
          "kv_handle": {"backend": "none", "endpoint": "tcp://127.0.0.1:1", "ctx_request_id": rid,
                        "layout": target.layout, "num_tokens": isl}}
    if mode != "metadata":   # relayed tokens are checked against the prompt CTX prefilled
        dp["kv_handle"]["prompt_digest"] = digest_of_tokens(ids, target.block_size)
    if mode == "list":
        dp["prompt_token_ids"] = ids.tolist()
    elif mode == "b64":
        import pybase64
        dp["prompt_token_ids_b64"] = pybase64.b64encode(ids.astype("<i4").tobytes()).decode()
    body = {"model": target.model, "prompt": "x", "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": False, "disaggregated_params": dp}
    return msgspec.json.encode(body).split(_MARK)


class _Usage(msgspec.Struct):
    prompt_tokens: int


class _Answer(msgspec.Struct):
    usage: _Usage


_ANSWER = msgspec.json.Decoder(_Answer)


def body_variants(target: Target, mode: str, isl: int, max_tokens: int) -> list[list[bytes]]:
    """The bodies a run cycles through. max_tokens > 1: 16 lengths spread evenly around it
    (mean max_tokens), so held requests finish at different steps and the closed loop does
    not settle into waves of `concurrency` requests arriving at once."""
    if max_tokens == 1:
        return [body_parts(target, mode, isl)]
    lengths = np.linspace(max(1, max_tokens // 2), max_tokens + max_tokens // 2, 16)
    return [body_parts(target, mode, isl, int(n)) for n in lengths.round()]


async def drive(spec: RunSpec, variants: list[list[bytes]]) -> dict:
    """One run: warm connections, /metrics, the requests at fixed concurrency, /metrics.
    Opening and closing the connections falls outside the two scrapes: a client keeps its
    connections, so accepting them is not a per-request cost."""
    url = spec.target.url.rstrip("/")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        conns = await _connect(url, spec.concurrency)
        await asyncio.sleep(spec.settle)
        before = await _scrape(http, url)
        latencies, failures, spans = [], [], []
        todo = itertools.count()                 # shared: each index is taken once
        deadline = time.monotonic() + spec.duration
        long_enough = time.monotonic() + spec.min_duration

        # Think times: each connection is a user who reads an answer before asking again,
        # so arrivals are spread out (nearly Poisson), not the bursts of one engine step's
        # finished requests that a closed loop without them sends back at once.
        think = np.random.default_rng(spec.concurrency)

        async def sender(k: int, conn: HTTPConnection):
            # A ramp spreads the first requests out: all at once, they queue as one burst
            # that a held load (max_tokens > 1) never has again.
            await asyncio.sleep(spec.ramp_up * k / spec.concurrency)
            for i in todo:
                now = time.monotonic()
                if now > deadline or (i >= spec.num_requests and now >= long_enough):
                    break
                rid = b"bench-%d-%d" % (os.getpid(), i)
                body = rid.join(variants[i % len(variants)])
                if not await _send(conn, body, spec, latencies, failures, spans):
                    conn.close()      # a failed connection is replaced
                    conns[k] = conn = await HTTPConnection.open(url)
                if spec.think_time:
                    await asyncio.sleep(think.exponential(spec.think_time))
        start, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(sender(k, c) for k, c in enumerate(conns)))
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        # Past the ramp and before the deadline (what follows only drains), or the whole run.
        window = (start + spec.ramp_up, start + min(spec.duration, elapsed))
        if window[1] <= window[0]:
            window = (start, start + elapsed)
        await asyncio.sleep(spec.settle)
        after = await _scrape(http, url)
        for conn in conns:
            conn.close()
    return {"latencies_s": latencies, "in_flight": _mean_in_flight(spans, *window),
            "failures": failures[:5], "num_failed": len(failures),
            "duration_s": elapsed, "client_cpu_s": cpu, "body_bytes": len(b"bench-0-0".join(variants[0])),
            "metrics_before": before, "metrics_after": after}


async def _connect(url: str, n: int, wave: int = 100) -> list[HTTPConnection]:
    """n keep-alive connections, each proven by a GET /health, opened in waves that a
    listen backlog absorbs (a thousand at once may overflow it and be reset later)."""
    conns: list[HTTPConnection] = []
    while len(conns) < n:
        new = await asyncio.gather(*(HTTPConnection.open(url) for _ in range(min(wave, n - len(conns)))))
        for status, _, _ in await asyncio.gather(*(c.request(b"GET", "/health") for c in new)):
            if status != 200:
                raise ConnectionError(f"GET /health answered {status}")
        conns += new
    return conns


def _mean_in_flight(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Time-averaged number of requests sent and not yet answered over [lo, hi]."""
    if not spans or hi <= lo:
        return 0.0
    s = np.asarray(spans)
    overlap = np.minimum(s[:, 1], hi) - np.maximum(s[:, 0], lo)
    return float(np.clip(overlap, 0, None).sum() / (hi - lo))


async def _send(conn: HTTPConnection, body: bytes, spec: RunSpec, latencies: list,
                failures: list, spans: list) -> bool:
    """One request; False if the connection failed."""
    t0 = time.perf_counter()
    try:
        status, data, _ = await asyncio.wait_for(conn.post("/v1/completions", body), spec.timeout)
    except (ConnectionError, OSError, TimeoutError) as exc:
        failures.append(f"{type(exc).__name__}: {exc}")
        return False
    t1 = time.perf_counter()
    spans.append((t0, t1))
    elapsed = t1 - t0
    if status != 200:
        failures.append(f"HTTP {status}: {data[:300].decode(errors='replace')}")
        return True
    try:
        got = _ANSWER.decode(data).usage.prompt_tokens
    except msgspec.DecodeError as exc:
        got = f"an unreadable answer ({exc})"
    if got != spec.isl:
        failures.append(f"usage.prompt_tokens is {got}, not the relayed {spec.isl}")
        return True
    latencies.append(elapsed)
    return True


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
    cached: dict[tuple[str, int, int], list[list[bytes]]] = {}   # bodies of one ISL at a time
    with asyncio.Runner(loop_factory=factory) as runner:
        while (raw := conn.recv_bytes()) != b"":
            spec = msgspec.msgpack.decode(raw, type=RunSpec)
            try:
                key = (spec.mode, spec.isl, spec.max_tokens)
                if key not in cached:
                    cached = {k: v for k, v in cached.items() if k[1] == spec.isl}
                    cached[key] = body_variants(spec.target, spec.mode, spec.isl, spec.max_tokens)
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
