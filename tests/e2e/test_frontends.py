"""`splitserve serve --api-server-count 2`: two HTTP front-end processes on one port over one
engine process (real processes, loopback, tiny model). Requests spread over both and answer
as one front-end does; /metrics adds them up; a front-end killed with -9 takes nothing else
down (the engine aborts its requests, a new one takes its place); a killed engine fails the
requests of both and comes back; SIGTERM leaves no process behind."""

import json
import os
import signal
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from server_utils import Worker, alive, descendants, kv_blocks_busy, metrics, post, wait_for
from test_faults_worker import RawStream   # a request of LONG tokens: runs until ended
PROMPTS = ["The quick brown fox", "Hello there", "One two three", "splitserve"]


@pytest.fixture(scope="module")
def workers():
    """(two front-ends, one front-end) started side by side."""
    args = ("--model", "tiny-random", "--dtype", "float32")
    with ThreadPoolExecutor(2) as pool:
        two = pool.submit(Worker, *args, "--api-server-count", "2")
        one = pool.submit(Worker, *args)
        started = [two.result(), one.result()]
    yield started
    for w in started:
        w.close()


def completion(worker, prompt, **body):
    return post(worker.url + "/v1/completions",
                {"model": "tiny-random", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                 **body}, timeout=60)


def listeners(port: int) -> set[int]:
    """Pids of the processes with a socket listening on the port."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(cols[9])
    return {pid for pid, inode in _socket_inodes() if inode in inodes}


def server_pid(sock: socket.socket) -> int:
    """The pid of the process holding the server side of a connection from this process."""
    local = sock.getsockname()[1]
    with open("/proc/net/tcp") as f:
        rows = [r.split() for r in f.read().splitlines()[1:]]
    inodes = {r[9] for r in rows if int(r[2].rsplit(":", 1)[1], 16) == local and r[3] == "01"}
    return next(pid for pid, inode in _socket_inodes() if inode in inodes)


def _socket_inodes():
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    yield int(pid), link[8:-1]
        except OSError:
            continue


def engine_of(worker) -> int:
    """The engine process: the spawned child that does not listen on the port."""
    frontends = listeners(worker.port)
    for pid in descendants(worker.proc.pid) - frontends:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            return pid
    raise LookupError("no engine process found")


class Stream(RawStream):
    """A long streaming completion on its own connection, and the front-end serving it."""

    def __init__(self, worker):
        super().__init__(worker)
        self.frontend = server_pid(self.sock)

    def rest(self) -> bytes:
        """Until [DONE] or the connection ends."""
        while b"data: [DONE]" not in self.data:
            try:
                chunk = self.sock.recv(1 << 20)
            except ConnectionResetError:
                break
            if not chunk:
                break
            self.data += chunk
        self.sock.close()
        return self.data


def streams_on_both(worker, frontends: set[int]) -> list[Stream]:
    """Open long streams until each front-end holds at least one."""
    streams: list[Stream] = []
    while {s.frontend for s in streams} != frontends:
        assert len(streams) < 40, "the kernel sent every connection to one front-end"
        streams.append(Stream(worker))
    return streams


def test_two_frontends_serve_one_engine_and_answer_as_one(workers):
    two, one = workers
    frontends = listeners(two.port)
    assert len(frontends) == 2 and frontends <= descendants(two.proc.pid)
    before = metrics(two.url)
    prompts = PROMPTS * 10
    with ThreadPoolExecutor(8) as pool:   # a new connection per request
        got = list(pool.map(lambda p: completion(two, p), prompts))
    want = {p: completion(one, p)[1]["choices"][0]["text"] for p in PROMPTS}
    assert all(status == 200 for status, _ in got)
    assert [body["choices"][0]["text"] for _, body in got] == [want[p] for p in prompts]

    key = 'splitserve_requests_total{endpoint="/v1/completions",status="200"}'

    def added(m, name):
        return m.get(name, 0) - before.get(name, 0)
    # Reports arrive twice a second: any front-end's /metrics soon gives the worker's totals.
    wait_for(lambda: added(metrics(two.url), key) == len(prompts), 10, "the totals")
    m = metrics(two.url)
    for name in ("splitserve_e2e_request_latency_seconds_count",
                 "splitserve_preprocessing_seconds_count"):
        assert added(m, name) == len(prompts)
    assert added(m, "splitserve_generation_tokens_total") == 8 * len(prompts)
    per_frontend = [v for k, v in m.items() if k.startswith("splitserve_frontend_requests_total")]
    assert len(per_frontend) == 2 and all(v > 0 for v in per_frontend)   # both served
    assert sum(per_frontend) == sum(v for k, v in m.items()
                                    if k.startswith("splitserve_requests_total"))


def _kv_free(url: str) -> bool:
    """kv_blocks_busy == 0; a reset connection counts as not yet: a handshake the kernel
    had queued on the killed front-end's socket as it closed is reset (the client retries,
    as any client of a restarting front-end would)."""
    try:
        return kv_blocks_busy(url) == 0
    except ConnectionResetError:
        return False


def test_a_killed_frontend_takes_nothing_else_down(workers):
    two, _ = workers
    engine, frontends = engine_of(two), listeners(two.port)
    streams = streams_on_both(two, frontends)
    victim = streams[0].frontend
    requests_before = metrics(two.url).get(   # (absent until a request has finished)
        'splitserve_requests_total{endpoint="/v1/completions",status="200"}', 0)
    os.kill(victim, signal.SIGKILL)
    # (a connection the kernel queued on its socket just before it died is reset: a
    # client retries it; this test opens none until the socket is gone)
    wait_for(lambda: not alive(victim), 10, "the front-end dead")
    for s in streams:
        if s.frontend == victim:     # cut off mid-stream
            assert b"data: [DONE]" not in s.rest()
        else:
            s.sock.close()           # the client leaves: its front-end aborts it
    # Its requests are aborted in the engine: their KV is freed long before LONG tokens.
    survivor = (frontends - {victim}).pop()
    wait_for(lambda: _kv_free(two.url), 30, "the KV blocks freed")
    assert alive(engine) and engine_of(two) == engine and alive(survivor)
    status, body = completion(two, "still here")
    assert status == 200
    wait_for(lambda: len(listeners(two.port)) == 2, 60, "a new front-end")
    assert victim not in listeners(two.port) and survivor in listeners(two.port)
    wait_for(lambda: metrics(two.url)['splitserve_requests_total{endpoint="/v1/completions",'
                                      'status="200"}'] >= requests_before + 1, 10, "counts kept")


def test_a_killed_engine_fails_the_requests_of_every_frontend_and_comes_back(workers):
    two, _ = workers
    old = engine_of(two)
    streams = streams_on_both(two, listeners(two.port))
    os.kill(old, signal.SIGKILL)
    for s in streams:
        data = s.rest().decode()
        events = [line[6:] for line in data.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "engine process stopped unexpectedly (signal 9" in \
            json.loads(events[-2])["error"]["message"]
    status, body = completion(two, "too soon")   # the new engine takes seconds to start
    assert status == 503 and "restarting" in body["error"]["message"]
    wait_for(lambda: completion(two, "back")[0] == 200, 120, "the engine back")
    wait_for(lambda: all(completion(two, p)[0] == 200 for p in PROMPTS * 4), 30,
             "every front-end serving again")
    assert not alive(old) and engine_of(two) != old
    wait_for(lambda: metrics(two.url)["splitserve_engine_restarts_total"] == 1, 10, "restarts")


def test_sigterm_stops_every_process(workers):
    two, _ = workers
    family = descendants(two.proc.pid)
    assert len(family) >= 4     # two front-ends, the engine, multiprocessing's tracker
    two.proc.send_signal(signal.SIGTERM)
    assert two.proc.wait(60) == 0
    wait_for(lambda: not any(alive(p) for p in family), 30, "every process stopped")


def test_a_killed_serve_process_leaves_nothing_behind():
    """kill -9 of the process that owns the engine and the front-ends: the engine sees its
    parent gone, the front-ends their pipe closed, and all of them exit."""
    worker = Worker("--model", "tiny-random", "--dtype", "float32", "--api-server-count", "2")
    try:
        family = descendants(worker.proc.pid)
        assert len(family) >= 4
        worker.proc.kill()
        worker.proc.wait(30)
        wait_for(lambda: not any(alive(p) for p in family), 30, "every process stopped")
    finally:
        worker.close()


def test_metrics_of_frontends_add_up():
    from splitserve.server.metrics import ServerMetrics
    a, b = ServerMetrics(), ServerMetrics()
    a.request_done("/v1/completions", 200)
    for m, seconds in ((a, 0.002), (b, 0.004), (b, 0.5)):
        m.request_done("/v1/completions", 200)
        m.gen_preprocessing.observe(seconds)
    from splitserve.protocol.engine import EngineStats
    stats = EngineStats(3, 0, 10, 100, 64, 32, kv_bytes_pulled=1000, kv_blocks_pulled=4,
                        kv_blocks_reused=60)
    a.update_engine(stats)    # engine-wide: every front-end has the same; not summed
    b.update_engine(stats)
    text = a.render({2: b.frontend_state()}, me=1).decode()
    for line in ("splitserve_kv_pulled_bytes_total 1000", "splitserve_kv_pulled_blocks_total 4",
                 "splitserve_kv_reused_blocks_total 60", "splitserve_prefix_cache_hits_total 32",
                 "splitserve_kv_blocks_used 10"):
        assert line in text
    assert 'splitserve_requests_total{endpoint="/v1/completions",status="200"} 4' in text
    assert "splitserve_gen_preprocessing_seconds_count 3" in text
    assert 'splitserve_frontend_requests_total{frontend="1"} 2' in text
    assert 'splitserve_frontend_requests_total{frontend="2"} 2' in text
    assert "splitserve_num_requests_running 3" in text
    assert a.render() == a.registry.render()   # alone: as before


def test_in_flight_counts_every_frontend():
    """WorkerServer.in_flight: this front-end's open generation requests and the others'."""
    from splitserve.protocol.frontends import FrontendReport
    from splitserve.server.app import WorkerServer
    from splitserve.server.engine_link import EngineLink

    class Server:
        in_flight = WorkerServer.in_flight
    server = Server()
    server.engine = EngineLink()
    server.engine.queues = {"a": None}
    server.engine.peer_reports = {2: FrontendReport(2, 3, {}), 3: FrontendReport(3, 1, {})}
    assert server.in_flight() == 5



def test_outputs_go_back_to_the_frontend_that_sent_the_request():
    from splitserve.engine.output_router import OutputRouter
    from splitserve.protocol.engine import CompletionDelta, EngineStats
    router, stats = OutputRouter(3), EngineStats(1, 0, 2, 10, 0, 0)
    router.admit("a", 1)
    router.admit("b", 2)
    deltas = [CompletionDelta(rid, 0, [5], "x") for rid in ("a", "b", "a")]
    routed = router.route(deltas, stats, news=False)
    assert [(p, [d.request_id for d in m.deltas]) for p, m in routed] == [(1, ["a", "a"]),
                                                                         (2, ["b"])]
    assert [p for p, _ in router.route([], stats, news=True)] == [0, 1, 2]   # stats: all
    assert router.gone(2) == ["b"]
    assert router.route([deltas[1]], stats, news=False)[0][0] == 0   # nobody's: dropped at 0
    router.prune(lambda rid: False)
    assert router.owners == {}


def test_the_count_reaches_serve_and_up_passes_it_to_gen_workers():
    from splitserve.cli import build_parser, server_config
    from splitserve.orchestrator.up import worker_command
    from splitserve.placement import WorkerPlan
    for flag in ("--api-server-count", "--frontends"):
        args = build_parser().parse_args(["serve", "--model", "tiny-random", flag, "3"])
        assert server_config(args, 1).api_server_count == 3
    assert server_config(build_parser().parse_args(["serve"]), 1).api_server_count == 1
    args = build_parser().parse_args(["up", "--gen-api-servers", "2"])
    args.log_level = "INFO"
    plan = WorkerPlan((1,), 1, (0,))
    assert worker_command(args, "gen", 9000, plan)[-2:] == ["--api-server-count", "2"]
    assert "--api-server-count" not in worker_command(args, "ctx", 9001, plan)
