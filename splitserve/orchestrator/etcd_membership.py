"""The members in etcd (`membership: etcd://host:port/prefix`): the third membership
backend beside registry.py's LocalMembership (one process) and RemoteMembership (a fleet on
one machine), for orchestrators on many machines.

Workers keep themselves in etcd (server/etcd_registration.py; the record and its MAC are
protocol/membership.py's). Every orchestrator reads the prefix once, then watches it from
the revision it read, so a join or a leave (a clean stop revokes the worker's lease; a dead
worker's lease lapses) reaches its pools as etcd sends it. A record whose MAC does not check
out under the cluster's secret is not a member, and is logged once per key.

etcd down (the watch breaks, or the one-second ping fails): the pools keep the last members
seen and route on; /health says so ("membership": {"connected": false, ...}), as does
/metrics (splitserve_orchestrator_membership_connected 0), and the log says it once; every second it tries again, and on its return the prefix is read whole
(joins and leaves missed meanwhile catch up) and watched again. The health checks
(probes.py) route around a member that went while etcd was away.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import orjson

from splitserve.etcd import EtcdClient, EtcdUnavailable, Event
from splitserve.metrics import Gauge
from splitserve.orchestrator.registry import PATHS
from splitserve.protocol.membership import EtcdTarget, MemberRecord, read
from splitserve.protocol.openai import error_body
from splitserve.trust import Keys

logger = logging.getLogger(__name__)

RETRY = 1.0            # seconds between tries while etcd does not answer
PING = 1.0             # seconds between checks that a quiet watch's etcd is still there


class EtcdMembers:
    """The members under the prefix as last read: etcd key -> its verified record."""

    def __init__(self, keys: Keys):
        self.keys = keys
        self.records: dict[str, MemberRecord] = {}
        self.refused: set[str] = set()     # keys whose bad record was logged

    def apply(self, events: list[Event]) -> bool:
        """Take a watch batch; whether the members changed."""
        before = dict(self.records)
        for event in events:
            self._take(event, before)
        return self.records != before

    def reset(self, events: list[Event]) -> bool:
        """The whole prefix, read again: members not in it left."""
        before, self.records = self.records, {}
        for event in events:
            self._take(event, before)
        return self.records != before

    def _take(self, event: Event, before: dict[str, MemberRecord]) -> None:
        """before: the members known until now (a member already known is not logged)."""
        record = None if event.value is None else read(event.key, event.value, self.keys)
        if record is None:
            self.records.pop(event.key, None)
            if event.value is not None and event.key not in self.refused:
                self.refused.add(event.key)
                logger.warning("orch: etcd key %.300s holds no record signed with this "
                               "cluster's internal secret; it is not a member", event.key)
            return
        self.refused.discard(event.key)
        if before.get(event.key) != record:
            logger.info("orch: %s worker %s is a member (etcd)", record.role, record.url)
            self._check_layout(record)
        self.records[event.key] = record

    def _check_layout(self, record: MemberRecord) -> None:
        """Say when a member's KV layout differs from the others' (a GEN cannot pull its
        blocks, or it theirs: the KV handshake refuses them; kv/base.layout_fingerprint)."""
        others = {r.layout for r in self.records.values() if r.layout and r.url != record.url}
        if record.layout and others and record.layout not in others:
            logger.warning("orch: %s worker %s's KV layout [%.200s] is not the other "
                           "members' [%.400s]: KV cannot move between them", record.role,
                           record.url, record.layout, "; ".join(sorted(others)))

    def listing(self) -> list[dict]:
        return [{"role": r.role, "url": r.url, "kv_endpoint": r.kv_endpoint, "model": r.model,
                 "layout": r.layout} for r in self.records.values()]


class EtcdMembership:
    """The membership interface of registry.py (call, members) over etcd, and its watch
    (run). listeners: called (no arguments) when a member joins or leaves."""

    def __init__(self, target: EtcdTarget, keys: Keys, registry):
        """registry: the orchestrator's metrics.Registry (the gauges below)."""
        self.target, self.current = target, EtcdMembers(keys)
        self.listeners: list = []
        self.connected = False
        self.down_since: float | None = time.monotonic()   # not read yet
        self.problem = "not read yet"
        p = "splitserve_orchestrator_membership_"
        self.connected_gauge = registry.register(Gauge(
            p + "connected", "1 while etcd answers; 0 while routing with the last members seen"))
        self.members_gauge = registry.register(Gauge(
            p + "members", "Workers in etcd whose records verify"))

    async def call(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        """The registration API: the members may be listed; joining is etcd's (409)."""
        if (method, path) in (("GET", PATHS[0]), ("HEAD", PATHS[0])):
            return 200, orjson.dumps({"object": "list", "data": self.current.listing()})
        if path == PATHS[2]:
            return 409, error_body("this cluster's members are in etcd, where a worker's role "
                                   "is in the record it signs: the planner cannot move it "
                                   "between pools here", "invalid_request_error")
        return 409, error_body(f"this cluster's members are in etcd: start the worker with "
                               f"--membership etcd://.../{self.target.prefix.lstrip('/')}",
                               "invalid_request_error")

    def listing(self) -> list[dict]:
        return self.current.listing()

    async def members(self) -> list[dict] | None:
        return self.current.listing()

    def health(self) -> dict:
        """/health's "membership": where, whether etcd answers, what is routed with."""
        state = {"backend": "etcd", "endpoint": self.target.endpoint,
                 "prefix": self.target.prefix, "connected": self.connected,
                 "members": len(self.current.records)}
        if not self.connected:
            state["unreachable_for_s"] = round(time.monotonic() - self.down_since, 1)
            state["problem"] = self.problem
        return state

    def _changed(self, changed: bool) -> None:
        self.members_gauge.set(len(self.current.records))
        if changed:
            for listener in self.listeners:
                listener()

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Read and watch the prefix for ever, reading it again after every break."""
        client = EtcdClient(session, self.target.endpoint)
        while True:
            try:
                revision, events = await client.range(self.target.workers)
                self._changed(self.current.reset(events))
                self._up()
                await _first_failure(self._follow(client, revision + 1), _ping(client))
            except (EtcdUnavailable, LookupError, TypeError, ValueError) as exc:
                # (LookupError ...: an answer without the fields etcd's answers have)
                self._down(str(exc) or type(exc).__name__)
                await asyncio.sleep(RETRY)

    async def _follow(self, client: EtcdClient, revision: int) -> None:
        async for events in client.watch(self.target.workers, revision):
            self._changed(self.current.apply(events))

    def _up(self) -> None:
        if not self.connected:
            was = "" if self.problem == "not read yet" else \
                f" again after {time.monotonic() - self.down_since:.1f} s"
            logger.info("orch: etcd at %s answers%s; %d members under %s", self.target.endpoint,
                        was, len(self.current.records), self.target.workers)
        self.connected, self.down_since = True, None
        self.connected_gauge.set(1)

    def _down(self, problem: str) -> None:
        first = self.connected or self.problem == "not read yet"    # said once per outage
        if self.connected:
            self.connected, self.down_since = False, time.monotonic()
        self.connected_gauge.set(0)
        self.problem = problem
        if first:
            logger.warning("orch: etcd is unreachable (%s); routing with the last %d members "
                           "seen, trying again every %g s", problem,
                           len(self.current.records), RETRY)


async def _ping(client: EtcdClient) -> None:
    """Raises EtcdUnavailable once etcd stops answering (a watch alone may wait silently
    on a connection nobody answers any more)."""
    while True:
        await asyncio.sleep(PING)
        await client.ping()


async def _first_failure(*coroutines) -> None:
    """Run them together until one ends; its exception (if any) is raised, the others are
    cancelled."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
