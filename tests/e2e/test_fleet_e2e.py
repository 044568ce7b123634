"""Orchestrator fleets and workers that come and go, on real processes (tiny model):
two orchestrators sharing workers route by the workers' reported load; two orchestrator
processes serve one port and outlive one of them; a worker added at run time gets traffic,
and one that leaves (deregistered, stopped cleanly, killed) stops getting it while a
steady client loop sees no failed request."""

import contextlib
import http.client
import json
import os
import signal
import threading
import time

import pytest
import yaml

from server_utils import (TEST_SECRET, Orchestrator, Worker, alive, call, engine_pid, internal,
                          get, metrics, post, stream, wait_for, wait_healthy)
from splitserve.bench.server_process import ServerProcess, free_port

MODEL = ("--model", "tiny-random", "--dtype", "float32")
BODY = {"model": "tiny-random", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
LONG = {**BODY, "max_tokens": 4000, "ignore_eos": True, "stream": True}
API = "/internal/workers"


@pytest.fixture(scope="module")
def workers():
    """One CTX and two GEN workers, shared by the tests (the last one kills a GEN)."""
    started = []
    try:
        for role in ("ctx", "gen", "gen"):
            started.append(Worker(*MODEL, "--role", role))
        yield started
    finally:
        for w in started:
            w.close()


def relayed(url: str) -> float:
    """generation_only requests this GEN front-end has taken."""
    return sum(v for k, v in metrics(url).items() if k.startswith("splitserve_token_relay_total"))


def load(url: str) -> dict:
    return json.loads(get(url + "/health")[1])["load"]


class Fleet(ServerProcess):
    """`splitserve orchestrator --processes N -c cluster.yaml`, healthy on return."""

    def __init__(self, tmp_path, ctx_urls, gen_urls, processes: int = 2, **config):
        port = free_port()
        path = tmp_path / f"fleet-{port}.yaml"
        path.write_text(yaml.safe_dump({
            "port": port, "health_check_interval": 0.5, "internal_secret": TEST_SECRET,
            "context_servers": {"urls": list(ctx_urls)},
            "generation_servers": {"urls": list(gen_urls), "router": "least_loaded"},
            **config}))
        super().__init__(["orchestrator", "-c", str(path), "--processes", str(processes)], port)
        wait_healthy(self, 60)

    def children(self) -> set[int]:
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            return {int(p) for p in f.read().split()}


def by_process(url: str, tries: int = 60) -> dict[int, tuple[dict, dict]]:
    """{pid: (its /health body, its /metrics)} of the fleet's processes that fresh
    connections reached (both asked on one keep-alive connection: the same process)."""
    host, port = url.removeprefix("http://").split(":")
    out = {}
    for _ in range(tries):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request("GET", "/health")
            health = json.loads(conn.getresponse().read())
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        out[health["pid"]] = (health, {k: float(v) for k, _, v in (
            line.rpartition(" ") for line in text.splitlines() if line and line[0] != "#")})
    return out


def completions_served(m: dict) -> float:
    return sum(v for k, v in m.items() if k.startswith("splitserve_orchestrator_requests_total")
               and 'endpoint="/v1/completions"' in k and 'status="200"' in k)


def test_two_orchestrators_sharing_workers_route_by_reported_load(tmp_path, workers):
    """One orchestrator keeps a GEN busy; the other, which sent it nothing, sends every
    request to the idle GEN (counting only its own requests, it would alternate)."""
    ctx, *gens = workers
    urls = ([ctx.url], [g.url for g in gens])
    first, second = (Orchestrator(tmp_path, *urls, load_poll_interval=0.2) for _ in range(2))
    conn = http.client.HTTPConnection("127.0.0.1", first.port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps(LONG),
                     {"Content-Type": "application/json"})
        assert conn.getresponse().status == 200
        wait_for(lambda: any(load(g.url)["running"] for g in gens), 30, "a GEN is busy")
        busy, idle = sorted(gens, key=lambda g: -load(g.url)["running"])
        time.sleep(1.0)                       # a few load polls of the second orchestrator
        before = relayed(busy.url), relayed(idle.url)
        for _ in range(6):
            assert post(second.url + "/v1/completions", BODY, headers={})[0] == 200
        assert load(busy.url)["running"] >= 1, "the long stream ended early"
        assert relayed(busy.url) - before[0] == 0
        assert relayed(idle.url) - before[1] == 6
    finally:
        conn.close()
        first.close()
        second.close()


def test_two_orchestrator_processes_serve_one_port_and_outlive_one(tmp_path, workers):
    ctx, gen, _ = workers
    fleet = Fleet(tmp_path, [ctx.url], [gen.url])
    try:
        children = fleet.children()
        assert len(children) == 2

        def each_served() -> bool:
            # urllib: a fresh connection each. A child that is still binding the port when
            # the first requests come gets none of them, so keep sending until both have.
            for _ in range(4):
                assert post(fleet.url + "/v1/completions", BODY, headers={})[0] == 200
            seen = by_process(fleet.url, 20)
            return set(seen) == children and all(completions_served(m) > 0
                                                 for _, m in seen.values())

        wait_for(each_served, 60, "both processes serving completions")
        victim = children.pop()
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: not alive(victim), 10, "the child gone")
        for _ in range(8):
            assert post(fleet.url + "/v1/completions", BODY, headers={})[0] == 200
        wait_for(lambda: len(fleet.children()) == 2, 30, "the child restarted")
        wait_for(lambda: set(by_process(fleet.url, 20)) == fleet.children(), 30,
                 "both processes serve again")
        family = fleet.children()
        fleet.proc.send_signal(signal.SIGINT)
        assert fleet.proc.wait(60) == 0
        wait_for(lambda: not any(alive(p) for p in family), 30, "every child gone")
    finally:
        fleet.close()


class SteadyClient:
    """Requests one after another through the front door (plain and streamed, alternately)
    on a thread, until stop(); every failure is kept."""

    def __init__(self, url: str):
        self.url, self.done, self.failures, self.count = url, threading.Event(), [], 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            try:
                if self.count % 2:
                    events = stream(self.url + "/v1/completions", BODY, headers={})
                    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
                else:
                    status, body = post(self.url + "/v1/completions", BODY, headers={})
                    assert status == 200, body
            except Exception as exc:   # noqa: BLE001 (every failure is the test's finding)
                self.failures.append(repr(exc))
            self.count += 1

    def stop(self) -> None:
        self.done.set()
        self.thread.join(120)


def members(url: str) -> set[str]:
    status, body, _ = call("GET", url + API, headers=internal(url))
    assert status == 200, body
    return {m["url"] for m in body["data"]}


def in_every_pool(fleet: Fleet, url: str, present: bool) -> bool:
    """Every process of the fleet has (or no longer has) `url` among its healthy GENs."""
    seen = by_process(fleet.url, 20)
    return set(seen) == fleet.children() and all(
        (url in health["healthy"]["gen"]) == present for health, _ in seen.values())


def test_workers_join_and_leave_a_fleet_without_failed_requests(tmp_path, workers):
    ctx, gen, other = workers
    fleet = Fleet(tmp_path, [ctx.url], [gen.url], remove_unhealthy_after=2.0)
    client, joined = None, None
    try:
        client = SteadyClient(fleet.url)
        # A worker started with --register joins every process's pool and gets traffic,
        # then stops cleanly: it leaves at once (well before its 10 s lease would lapse).
        joined = Worker(*MODEL, "--role", "gen", "--register", fleet.url)
        wait_for(lambda: in_every_pool(fleet, joined.url, True), 30, "joined every pool")
        wait_for(lambda: relayed(joined.url) > 0, 30, "the new worker gets traffic")
        joined.close()
        assert joined.url not in members(fleet.url)
        # Registered by hand, removed by hand: alive, it gets nothing more.
        call("POST", fleet.url + API, {"role": "generation", "url": other.url, "ttl": 60},
             headers=internal(fleet.url))
        wait_for(lambda: relayed(other.url) > 0, 30, "the registered worker gets traffic")
        call("DELETE", fleet.url + API, {"url": other.url}, headers=internal(fleet.url))
        wait_for(lambda: in_every_pool(fleet, other.url, False), 30, "left every pool")
        frozen, count = relayed(other.url), client.count
        wait_for(lambda: client.count >= count + 6, 60, "more requests served")
        assert relayed(other.url) == frozen
        # Registered again, then killed: routed around, then removed.
        call("POST", fleet.url + API, {"role": "generation", "url": other.url, "ttl": 60},
             headers=internal(fleet.url))
        wait_for(lambda: relayed(other.url) > frozen, 30, "it gets traffic again")
        engine = engine_pid(other)
        other.proc.send_signal(signal.SIGKILL)
        other.proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine, signal.SIGKILL)
        wait_for(lambda: other.url not in members(fleet.url), 30, "the dead worker removed")
        count = client.count
        wait_for(lambda: client.count >= count + 6, 60, "more requests served")
    finally:
        if client is not None:
            client.stop()
        if joined is not None:
            joined.close()
        fleet.close()
    assert client.failures == [], client.failures
    assert client.count >= 20


def processes_answering(url: str) -> set[int]:
    try:
        return set(by_process(url, 20))
    except OSError:                       # not listening yet
        return set()


def test_a_fleet_whose_parent_dies_leaves_nothing(tmp_path):
    """SIGKILL of the parent: each child reads EOF on its stdin and stops."""
    port = free_port()
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({"port": port, "internal_secret": TEST_SECRET,
                                    "context_servers": [], "generation_servers": []}))
    fleet = ServerProcess(["orchestrator", "-c", str(path), "--processes", "2"], port)
    try:
        wait_for(lambda: len(processes_answering(fleet.url)) == 2, 60, "both children serve")
        children = set(by_process(fleet.url, 1)) | Fleet.children(fleet)
        fleet.proc.send_signal(signal.SIGKILL)
        fleet.proc.wait()
        wait_for(lambda: not any(alive(p) for p in children), 30, "every child gone")
    finally:
        fleet.close()


def test_up_with_two_orchestrators_serves_through_registered_workers(tmp_path):
    from server_utils import UpCluster, descendants
    up = UpCluster(*MODEL, "--orchestrators", "2", log=tmp_path / "up.log", log_level="INFO")
    try:
        def both_route_to_both() -> bool:   # each process has synced the registry
            seen = by_process(up.url, 20)
            return len(seen) == 2 and all(len(h["healthy"]["ctx"]) == len(h["healthy"]["gen"])
                                          == 1 for h, _ in seen.values())
        wait_for(both_route_to_both, 30, "every orchestrator routes to both workers")
        for _ in range(6):
            assert post(up.url + "/v1/completions", BODY, headers={})[0] == 200
        assert len(members(up.url)) == 2
        family = descendants(up.proc.pid)
        assert len(family) >= 2 + 2 * 2   # orchestrators, workers, engines
        up.interrupt()
    finally:
        family = descendants(up.proc.pid) if up.proc.poll() is None else set()
        up.close()
        for pid in family:                 # a failed test leaves no worker behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
