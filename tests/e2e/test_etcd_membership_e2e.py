"""Membership in etcd with real processes: a real etcd server on free loopback ports, two
orchestrator processes watching one prefix (as on two machines: each its own control
plane), and tiny-random workers that join with `--membership etcd://...`.

What a user would notice: a worker joining is routed to by both orchestrators within a
second; one killed outright leaves both when its lease lapses, one stopped cleanly at once;
a record not signed with the cluster's secret is never a member (and is logged once); with
etcd stopped both keep routing with the members they had, /health says etcd is
unreachable, and when etcd returns they catch up with what changed; a deleted record is
put again, a restarted engine's new KV endpoint reaches both; every process of a fleet
watches etcd."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from etcd_utils import EtcdServer
from server_utils import (TEST_SECRET, Worker, call, engine_pid, get, internal, metrics,
                          post, wait_for)
from splitserve.bench.server_process import ServerProcess, free_port
from splitserve.protocol.membership import MemberRecord, parse_target, sign
from splitserve.trust import Keys

PREFIX = "/splitserve-test"
TTL = 2
WORKER = ("--model", "tiny-random", "--dtype", "float32")
BODY = {"model": "tiny-random", "prompt": "The cluster keeps routing", "max_tokens": 4,
        "ignore_eos": True,
        "temperature": 0}


class Orchestrator(ServerProcess):
    """`splitserve orchestrator` with no static workers, members from etcd, its log kept."""

    def __init__(self, tmp_path, membership: str, processes: int = 1):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = tmp_path / f"cluster-{self.port}.yaml"
        path.write_text(yaml.safe_dump({
            "port": self.port, "health_check_interval": 0.5, "internal_secret": TEST_SECRET,
            "membership": membership, "processes": processes}))
        self.log = tmp_path / f"orch-{self.port}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "splitserve.cli", "--log-level", "INFO",
                 "orchestrator", "-c", str(path)], stdout=out, stderr=subprocess.STDOUT)
        wait_for(self._answers, 60, "the orchestrator listening")

    def _answers(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            get(self.url + "/health")
            return True
        except OSError:
            return False

    def members(self) -> dict[str, str]:
        status, body, _ = call("GET", self.url + "/internal/workers",
                               headers=internal(self.url))
        assert status == 200, body
        return {m["url"]: m["role"] for m in body["data"]}

    def membership(self) -> dict:
        return call("GET", self.url + "/health")[1]["membership"]


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def target(etcd) -> str:
    return f"etcd://127.0.0.1:{etcd.endpoint.rsplit(':', 1)[1]}{PREFIX}?ttl={TTL}"


@pytest.fixture(scope="module")
def orchs(tmp_path_factory, target):
    tmp = tmp_path_factory.mktemp("orchs")
    both = [Orchestrator(tmp, target), Orchestrator(tmp, target)]
    yield both
    for o in both:
        o.close()


def signed(url: str, secret: str = TEST_SECRET) -> tuple[str, bytes]:
    key = parse_target("etcd://h:1" + PREFIX).key(url)
    return key, sign(MemberRecord("context", url), key, Keys(secret))


def seen_by_all(orchs, url: str, present: bool = True) -> bool:
    return all((url in o.members()) == present for o in orchs)


def test_a_join_and_a_leave_reach_both_orchestrators_within_a_second(etcd, orchs):
    wait_for(lambda: all(o.membership()["connected"] for o in orchs), 10, "both read etcd")
    url = f"http://127.0.0.1:{free_port()}"
    key, value = signed(url)
    lease = etcd.grant(30)
    t0 = time.monotonic()
    etcd.put(key, value, lease)
    wait_for(lambda: seen_by_all(orchs, url), 1.0, "the join seen by both within 1 s")
    joined = time.monotonic() - t0
    t0 = time.monotonic()
    etcd.revoke(lease)
    wait_for(lambda: seen_by_all(orchs, url, False), 1.0, "the leave seen by both within 1 s")
    print(f"join seen by both in {joined * 1000:.0f} ms, "
          f"leave in {(time.monotonic() - t0) * 1000:.0f} ms")


def test_a_record_without_the_secrets_mac_is_ignored_and_logged_once(etcd, orchs):
    url = f"http://127.0.0.1:{free_port()}"
    key, value = signed(url, "not-the-cluster-secret-0123456789")
    etcd.put(key, value)
    etcd.put(key, value)            # written again: not logged again
    good_url = f"http://127.0.0.1:{free_port()}"
    good_key, good_value = signed(good_url)
    etcd.put(good_key, good_value)  # a good record after it: the watch took both
    wait_for(lambda: seen_by_all(orchs, good_url), 2.0, "the signed record seen")
    line = f"etcd key {key} holds no record signed with this cluster's internal secret"
    for o in orchs:
        assert url not in o.members()
        assert o.log.read_text().count(line) == 1, o.log.read_text()[-3000:]
    etcd.call("/v3/kv/deleterange", {"key": _b64(key)})
    etcd.call("/v3/kv/deleterange", {"key": _b64(good_key)})
    wait_for(lambda: seen_by_all(orchs, good_url, False), 2.0, "the signed record gone")


@pytest.fixture(scope="module")
def workers(target):
    ctx = Worker(*WORKER, "--role", "ctx", "--membership", target)
    gen = Worker(*WORKER, "--role", "gen", "--membership", target)
    yield ctx, gen
    for w in (ctx, gen):
        w.close()


def served(o) -> bool:
    status, body = post(o.url + "/v1/completions", BODY, timeout=60)
    assert status == 200, body
    return body["usage"]["completion_tokens"] == 4


def test_workers_joining_through_etcd_are_routed_to_by_both(orchs, workers):
    ctx, gen = workers
    for o in orchs:
        wait_for(lambda: o.members() == {ctx.url: "context", gen.url: "generation"}, 10,
                 "both workers members")
        wait_for(lambda: get(o.url + "/health")[0] == 200, 10, "both pools healthy")
        assert served(o)


def test_with_etcd_stopped_both_keep_routing_and_catch_up_when_it_returns(etcd, orchs,
                                                                          workers):
    ctx, gen = workers
    etcd.stop()
    for o in orchs:
        wait_for(lambda: not o.membership()["connected"], 5, "/health saying etcd is down")
        state = o.membership()
        assert state["members"] == 2 and state["problem"], state
        assert metrics(o.url)["splitserve_orchestrator_membership_connected"] == 0
        assert served(o)     # the last members seen
        assert o.members() == {ctx.url: "context", gen.url: "generation"}
    time.sleep(TTL + 1)      # longer than a lease: etcd's restart must not drop the workers
    for o in orchs:
        assert served(o)
    etcd.start()
    url = f"http://127.0.0.1:{free_port()}"
    key, value = signed(url)
    etcd.put(key, value)     # a change the watches were not there for
    for o in orchs:
        wait_for(lambda: o.membership()["connected"], 5, "etcd reachable again on /health")
        assert metrics(o.url)["splitserve_orchestrator_membership_connected"] == 1
        wait_for(lambda: url in o.members(), 3, "the change made meanwhile")
        assert o.members() == {ctx.url: "context", gen.url: "generation", url: "context"}
        assert served(o)
        log = o.log.read_text()
        assert log.count("etcd is unreachable") == 1 and "answers again after" in log
    etcd.call("/v3/kv/deleterange", {"key": _b64(key)})


def test_a_worker_whose_record_was_deleted_puts_it_again(etcd, orchs, workers):
    ctx, gen = workers
    key = parse_target("etcd://h:1" + PREFIX).key(gen.url)
    etcd.call("/v3/kv/deleterange", {"key": _b64(key)})
    wait_for(lambda: seen_by_all(orchs, gen.url, False), 1.0, "the deleted record gone")
    wait_for(lambda: seen_by_all(orchs, gen.url), TTL + 1.0, "the record put again")


def test_a_restarted_engine_s_new_kv_endpoint_reaches_both(orchs, workers):
    ctx, _ = workers

    def kv_endpoints() -> set[str]:
        return {m["kv_endpoint"] for o in orchs for m in call(
            "GET", o.url + "/internal/workers", headers=internal(o.url))[1]["data"]
            if m["url"] == ctx.url}
    before = kv_endpoints()
    assert len(before) == 1 and next(iter(before)).startswith("tcp://"), before
    os.kill(engine_pid(ctx), signal.SIGKILL)     # the front-end starts it again
    wait_for(lambda: len(after := kv_endpoints()) == 1 and after != before
             and next(iter(after)).startswith("tcp://"), 90, "the new KV endpoint in etcd")
    wait_for(lambda: all(post(o.url + "/v1/completions", BODY, timeout=60)[0] == 200
                         for o in orchs), 30, "served after the restart")


def test_a_killed_worker_leaves_both_when_its_lease_lapses(orchs, workers):
    ctx, gen = workers
    os.kill(gen.proc.pid, signal.SIGKILL)     # no revoke: only the lease's end says so
    gen.proc.wait()
    t0 = time.monotonic()
    wait_for(lambda: seen_by_all(orchs, gen.url, False), TTL + 2.0, "the dead worker gone")
    print(f"the killed worker left both after {time.monotonic() - t0:.1f} s (ttl {TTL} s)")
    assert all(ctx.url in o.members() for o in orchs)
    ctx.close()                               # a clean stop revokes its lease: gone at once
    wait_for(lambda: seen_by_all(orchs, ctx.url, False), 1.0, "the stopped worker gone")


def test_every_process_of_a_fleet_watches_etcd(tmp_path, etcd, target):
    fleet = Orchestrator(tmp_path, target, processes=2)
    try:
        url = f"http://127.0.0.1:{free_port()}"
        key, value = signed(url)
        etcd.put(key, value)
        # each answer comes from whichever process the kernel picked: all must list it
        wait_for(lambda: all(url in fleet.members() for _ in range(8)), 5,
                 "every process of the fleet listing the member")
        status, body, _ = call("POST", fleet.url + "/internal/workers",
                               {"role": "generation", "url": "http://127.0.0.1:1"},
                               headers=internal(fleet.url))
        assert status == 409 and "--membership" in body["error"]["message"]
        etcd.call("/v3/kv/deleterange", {"key": _b64(key)})
    finally:
        fleet.close()


def _b64(text: str) -> str:
    import base64
    return base64.b64encode(text.encode()).decode()
