"""Faults injected into a real cluster (orchestrator, CTX and GEN worker processes, tiny
model): workers killed with SIGKILL before, during and after their part of a request, engines
stalled with SIGSTOP to hold a request at a known point, and load past max_in_flight.
After each, every live worker's KV blocks are free again."""

import concurrent.futures
import contextlib
import http.client
import json
import os
import re
import signal
import urllib.error
import urllib.request

import pytest

from server_utils import (Orchestrator, UpCluster, Worker, descendants, engine_pid, get, metrics,
                          post, stream, wait_for, wait_kv_free)

MODEL = ("--model", "tiny-random", "--dtype", "float32")
BODY = {"model": "tiny-random", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
LONG = {**BODY, "max_tokens": 4000, "ignore_eos": True}
INTERNAL = re.compile(r"aiohttp|Error\(|http://|tcp://|Traceback", re.I)


def kill(worker) -> None:
    """SIGKILL a worker's front-end and its engine (a stopped engine would not notice)."""
    engine = engine_pid(worker)
    worker.proc.send_signal(signal.SIGKILL)
    worker.proc.wait()
    with contextlib.suppress(ProcessLookupError):   # it may have noticed and gone
        os.kill(engine, signal.SIGKILL)


def stall(worker) -> int:
    """SIGSTOP the worker's engine: its front-end still takes requests and answers /health."""
    pid = engine_pid(worker)
    os.kill(pid, signal.SIGSTOP)
    return pid


def relayed(worker) -> float:
    """generation_only requests this GEN front-end has taken."""
    return sum(v for k, v in metrics(worker.url).items()
               if k.startswith("splitserve_token_relay_total"))


def retries(orch, pool: str, reason: str) -> float:
    key = f'splitserve_orchestrator_retries_total{{pool="{pool}",reason="{reason}"}}'
    return metrics(orch.url).get(key, 0.0)


def text_of(events) -> str:
    assert events[-1] == "[DONE]", events[-3:]
    assert not any("error" in e for e in events[:-1]), events
    return "".join(c["text"] for e in events[:-1] for c in e["choices"])


def resume(worker) -> None:
    """SIGCONT to a worker's processes: a stalled engine cannot stop itself."""
    for pid in descendants(worker.proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def reusable(worker) -> bool:
    """Still serving, idle, every KV block free: as good as a freshly started one."""
    try:
        m = metrics(worker.url)
    except OSError:
        return False
    return (worker.proc.poll() is None and m["splitserve_num_requests_running"] == 0
            and m["splitserve_kv_blocks_used"] + m["splitserve_kv_blocks_leased"] == 0)


class WorkerPool:
    """This file's workers, shared by its tests by their arguments: a test takes the ones it
    needs (started when too few are idle); at its end those still serving and idle come back
    and the rest (killed, or left busy by a failure) are closed. Each test starts its own
    orchestrator, so what it counts there is its own; what it reads from a worker's
    counters is the change over the test."""

    def __init__(self):
        self.idle: dict[tuple[str, ...], list[Worker]] = {}

    def take(self, n: int, args: tuple[str, ...]) -> list[Worker]:
        idle = self.idle.setdefault(args, [])
        while len(idle) < n:
            idle.append(Worker(*MODEL, *args))
        taken, self.idle[args] = idle[:n], idle[n:]
        return taken

    def give_back(self, args: tuple[str, ...], worker) -> None:
        resume(worker)
        if reusable(worker):
            self.idle[args].append(worker)
        else:
            worker.close()

    def close(self) -> None:
        for worker in (w for ws in self.idle.values() for w in ws):
            worker.close()


@pytest.fixture(scope="module")
def workers():
    pool = WorkerPool()
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def cluster(tmp_path, workers):
    """build(n_ctx, n_gen, ctx_args, gen_args, **orchestrator config) -> (ctxs, gens, orch):
    workers from the pool, an orchestrator of the test's own; the orchestrator is stopped
    and the workers given back at the end, whatever failed."""
    taken, orchs, pool = [], [], concurrent.futures.ThreadPoolExecutor(2)

    def build(n_ctx=1, n_gen=1, ctx_args=(), gen_args=(), **config):
        ctx_args, gen_args = ("--role", "ctx", *ctx_args), ("--role", "gen", *gen_args)
        ctxs, gens = workers.take(n_ctx, ctx_args), workers.take(n_gen, gen_args)
        taken.extend([(ctx_args, w) for w in ctxs] + [(gen_args, w) for w in gens])
        orchs.append(Orchestrator(tmp_path, [c.url for c in ctxs], [g.url for g in gens],
                                  **config))
        return ctxs, gens, orchs[-1]
    build.submit = pool.submit
    yield build
    for orch in orchs:
        orch.close()
    for args, worker in taken:
        workers.give_back(args, worker)
    pool.shutdown(cancel_futures=True)


def test_gen_killed_before_its_first_event_is_retried_on_another_gen(cluster):
    (ctx,), gens, orch = cluster(1, 2, ("--kv-lease-seconds", "3"))
    want = post(gens[0].url + "/v1/completions", BODY)[1]["choices"][0]["text"]
    before = [relayed(g) for g in gens]
    engines = [stall(g) for g in gens]
    pending = cluster.submit(stream, orch.url + "/v1/completions", BODY)
    wait_for(lambda: relayed(gens[0]) + relayed(gens[1]) > sum(before), 60,
             "a GEN holds the request")
    victim = 0 if relayed(gens[0]) > before[0] else 1
    kill(gens[victim])
    os.kill(engines[1 - victim], signal.SIGCONT)
    assert text_of(pending.result(120)) == want
    assert retries(orch, "gen", "disconnected") == 1
    wait_kv_free([ctx.url, gens[1 - victim].url])    # the first prefill's lease expires


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_gen_killed_mid_stream_is_continued_on_another_gen(cluster, sampling):
    """Mid-stream migration: the client's stream goes on from the tokens it already has and
    ends exactly as an uninterrupted run, greedy or seeded."""
    (ctx,), gens, orch = cluster(1, 2, ("--kv-lease-seconds", "3"))
    body = {**BODY, "max_tokens": 1000, "ignore_eos": True, **sampling}
    want = text_of(stream(orch.url + "/v1/completions", body))
    before = [relayed(g) for g in gens]
    conn, resp = open_stream(orch.port, body)
    assert resp.status == 200
    head = read_events(resp, 2)
    victim = 0 if relayed(gens[0]) > before[0] else 1
    stall(gens[victim])          # hold it mid-stream, then kill it
    kill(gens[victim])
    rest = read_events(resp)
    conn.close()
    events = head + rest
    assert text_of(events) == want
    assert len({e["id"] for e in events[:-1]}) == 1
    done = 'splitserve_orchestrator_migrations_total{outcome="completed"}'
    wait_for(lambda: metrics(orch.url).get(done) == 1, 30, "the migration is counted")
    assert retries(orch, "gen", "disconnected") == 0    # nothing retried after the first byte
    wait_kv_free([ctx.url, gens[1 - victim].url])


def test_gen_killed_mid_stream_without_migration_ends_with_an_error(cluster):
    (ctx,), gens, orch = cluster(1, 2, ("--kv-lease-seconds", "3"), migrate_streams=False)
    before = relayed(gens[0])
    conn, resp = open_stream(orch.port, LONG)
    assert resp.status == 200
    assert "choices" in read_events(resp, 2)[0]
    victim = 0 if relayed(gens[0]) > before else 1
    kill(gens[victim])
    rest = read_events(resp)
    conn.close()
    assert rest[-1] == "[DONE]"
    error = rest[-2]["error"]
    assert "stopped while streaming this response" in error["message"]
    assert error["type"] == "server_error" and not INTERNAL.search(error["message"])
    for _ in range(3):     # the other GEN keeps serving
        assert post(orch.url + "/v1/completions", BODY)[0] == 200
    assert retries(orch, "gen", "disconnected") == 0    # nothing after the first byte
    wait_kv_free([ctx.url, gens[1 - victim].url])


@pytest.mark.parametrize("streamed, reason", [(False, "server_error"), (True, "error_event")])
def test_ctx_killed_after_its_prefill_is_retried_with_a_fresh_prefill(cluster, streamed, reason):
    """GEN's pull from the dead CTX fails: it answers 500, or streams an error as its first
    event; either way nothing reached the client, and the request prefills again."""
    ctxs, (gen,), orch = cluster(2, 1, gen_args=("--kv-timeout", "3"))
    want = post(gen.url + "/v1/completions", BODY)[1]["choices"][0]["text"]
    before = relayed(gen)
    engine = stall(gen)
    url = orch.url + "/v1/completions"
    pending = cluster.submit(stream, url, BODY) if streamed else cluster.submit(post, url, BODY)
    wait_for(lambda: relayed(gen) > before, 60, "the GEN holds the request")
    leased = [metrics(c.url)["splitserve_kv_blocks_leased"] > 0 for c in ctxs]
    assert sum(leased) == 1
    victim = leased.index(True)
    kill(ctxs[victim])
    os.kill(engine, signal.SIGCONT)
    if streamed:
        assert text_of(pending.result(120)) == want
    else:
        status, got = pending.result(120)
        assert status == 200 and got["choices"][0]["text"] == want
    assert retries(orch, "gen", reason) == 1
    wait_kv_free([ctxs[1 - victim].url, gen.url])


def test_shedding_past_max_in_flight(cluster):
    (ctx,), (gen,), orch = cluster(max_in_flight=2)
    engine = stall(gen)
    held = [cluster.submit(stream, orch.url + "/v1/completions", BODY) for _ in range(2)]
    in_flight = "splitserve_orchestrator_requests_in_flight"
    wait_for(lambda: metrics(orch.url)[in_flight] == 2, 60, "two requests in flight")
    status, headers, body = raw_post(orch.url + "/v1/completions", BODY)
    assert status == 503 and int(headers["Retry-After"]) >= 1
    assert "at capacity" in body["error"]["message"]
    os.kill(engine, signal.SIGCONT)
    for f in held:
        assert text_of(f.result(120))
    assert post(orch.url + "/v1/completions", BODY)[0] == 200
    wait_kv_free([ctx.url, gen.url])


def test_clients_that_disconnect_at_random_points_leave_nothing_behind(cluster):
    """Clients hang up during CTX's prefill, the relay, GEN's pull and the stream; every
    engine request is aborted or ends, every KV block is free again, and the cluster serves."""
    import random
    import socket
    import time
    (ctx,), (gen,), orch = cluster(1, 1, ("--kv-lease-seconds", "3"))
    want = text_of(stream(orch.url + "/v1/completions", BODY))
    rng = random.Random(17)
    socks = []
    for i in range(24):
        body = {**LONG, "max_tokens": rng.choice([4, 64, 400]), "stream": rng.random() < 0.5}
        data = json.dumps(body).encode()
        s = socket.create_connection(("127.0.0.1", orch.port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        socks.append((time.monotonic() + rng.uniform(0, 1.5), s))
    for deadline, s in sorted(socks, key=lambda item: item[0]):
        time.sleep(max(0.0, deadline - time.monotonic()))
        s.close()
    wait_kv_free([ctx.url, gen.url], timeout=60)
    wait_for(lambda: metrics(gen.url)["splitserve_num_requests_running"] == 0, 60,
             "the GEN engine is idle")
    assert text_of(stream(orch.url + "/v1/completions", BODY)) == want
    assert metrics(orch.url)["splitserve_orchestrator_requests_in_flight"] == 0


def test_timeouts_bound_each_wait_not_the_whole_stream(cluster):
    (ctx,), (gen,), orch = cluster(ctx_args=("--kv-lease-seconds", "3"), first_byte_timeout=2,
                                   idle_timeout=2)
    # ~4 s on the tiny model: a stream outlives both timeouts (aiohttp's total ended it)
    assert text_of(stream(orch.url + "/v1/completions", {**LONG, "max_tokens": 2000}))
    engine = stall(gen)
    status, err = post(orch.url + "/v1/completions", BODY)     # no first byte in 2 s
    assert status == 504 and err["error"]["message"] == \
        "the generation worker did not answer within 2 s"
    os.kill(engine, signal.SIGCONT)
    conn, resp = open_stream(orch.port, LONG)
    assert "choices" in read_events(resp, 2)[0]
    os.kill(engine, signal.SIGSTOP)       # the stream stalls mid-way
    rest = read_events(resp)
    conn.close()
    os.kill(engine, signal.SIGCONT)
    assert rest[-1] == "[DONE]" and "sent nothing for 2 s" in rest[-2]["error"]["message"]
    assert sum(v for k, v in metrics(orch.url).items() if "retries_total" in k) == 0
    wait_kv_free([ctx.url, gen.url])


def test_up_restarts_a_killed_worker(tmp_path):
    log = tmp_path / "up.log"
    up = UpCluster(*MODEL, "--num-gen", "2", log=log, log_level="INFO")
    gen_url, port = f"http://127.0.0.1:{up.port + 3}", up.port + 3
    try:
        # up's workers register as each comes up: the orchestrator answers /health once each
        # pool has one, which may be before the second GEN has joined
        wait_for(lambda: _gens_healthy(up.url) == 2, 60, "both GENs registered")
        victim = _worker_pid(up.proc.pid, port)
        os.kill(victim, signal.SIGKILL)
        for _ in range(4):    # meanwhile: routed around the dead GEN
            assert post(up.url + "/v1/completions", BODY)[0] == 200
        wait_for(lambda: _worker_pid(up.proc.pid, port, victim) and _gens_healthy(up.url) == 2,
                 180, "the GEN restarted and healthy again")
        text = log.read_text()
        assert re.search(rf"gen worker {gen_url} \(pid {victim}\) was killed by SIGKILL; "
                         r"restarting it in 1 s", text), text[-3000:]
        assert f"gen worker {gen_url} restarted" in text
        assert f"gen server {gen_url} is up" in text
        for _ in range(4):    # afterwards: both GENs serve
            assert post(up.url + "/v1/completions", BODY)[0] == 200
        wait_kv_free([f"http://127.0.0.1:{up.port + i}" for i in (1, 2, 3)])
        up.interrupt()
    finally:
        up.close()


def _gens_healthy(url: str) -> int:
    return len(json.loads(get(url + "/health")[1])["healthy"]["gen"])


def _worker_pid(parent: int, port: int, not_pid: int | None = None) -> int | None:
    """The pid of `up`'s worker child serving on `port` (other than not_pid)."""
    for pid in descendants(parent):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if b"serve" in cmd and str(port).encode() in cmd and pid != not_pid:
            return pid
    return None


def open_stream(port: int, body: dict):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def read_events(resp, n: int | None = None) -> list:
    """The next n SSE events (all, to the end of the stream, if n is None)."""
    events = []
    while n is None or len(events) < n:
        line = resp.readline()
        if not line:
            break
        assert not line.startswith(b":"), f"an internal comment reached the client: {line!r}"
        if line.startswith(b"data: "):
            payload = line[6:].strip()
            events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def raw_post(url: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())
