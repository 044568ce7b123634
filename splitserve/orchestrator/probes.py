"""Watching the workers: health checks (every health_check_interval, every server of both
pools), the faster load poll (every load_poll_interval, the healthy ones), and, before each
round of health checks, the pools' registered members read from the registry
(orchestrator/registry.py).

Both probes are GET /health with a fresh challenge and no token (trust.py): a server is
healthy only if it answers 200 and proves its identity, which records its instance id and
the credentials requests to it use (cluster.Credentials). A process that took a dead
worker's port cannot prove it, so it is never routed to. Its 200 says the worker serves,
its "load" object what it holds (Server.report). The load poll costs a worker one small
request per orchestrator process per interval (measured in docs/reliability.md's
orchestrator section).

A server that fails a request in a way that puts its identity in doubt (pools.Pool.mark_down)
is checked again at once (recheck), not at the next interval: a worker that restarted is
verified again, and served, within milliseconds."""

from __future__ import annotations

import asyncio
import logging
import weakref

import aiohttp
import orjson

from splitserve.orchestrator.upstream import read_at_most
from splitserve.trust import CHALLENGE_HEADER, IDENTITY_HEADER, Keys, new_challenge

logger = logging.getLogger(__name__)

PROBE = aiohttp.ClientTimeout(total=2.0)   # health checks, load polls and /v1/models
PROBE_MAX_BYTES = 1 << 20                   # a /health or /v1/models body past this: garbage
UNPROVEN = ("it does not prove its identity: not a worker of this cluster (another process "
            "on its port?), or its internal secret is not this orchestrator's")


async def challenge(session: aiohttp.ClientSession, keys: Keys,
                    url: str) -> tuple[int | None, str | None, bytes | None]:
    """GET url/health with a fresh challenge: (its status, None if it did not answer; the
    instance id it proved, else None; its body if it answered 200 within PROBE_MAX_BYTES
    and proved it, else None)."""
    nonce = new_challenge()
    try:
        async with session.get(url + "/health", headers={CHALLENGE_HEADER: nonce},
                               timeout=PROBE, allow_redirects=False) as r:
            instance = keys.verify(nonce, r.headers.get(IDENTITY_HEADER))
            body = (await read_at_most(r, PROBE_MAX_BYTES)
                    if instance is not None and r.status == 200 else None)
            return r.status, instance, body
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None, None, None


class Probes:
    def __init__(self, pools):
        self.pools = pools          # pools.Pools: its session, keys, config and both pools
        self.membership = None
        self.tasks: list[asyncio.Task] = []
        self.pending: dict = {}     # Server -> its recheck under way
        self.verdicts = weakref.WeakKeyDictionary()   # Server -> its last verdict, logged

    def start(self, membership=None) -> None:
        """membership: registry.LocalMembership or RemoteMembership (None: static only)."""
        self.membership = membership
        self.tasks = [asyncio.create_task(self._health_loop())]
        if self.pools.config.load_poll_interval > 0:
            self.tasks.append(asyncio.create_task(self._load_loop()))

    def stop(self) -> None:
        for task in [*self.tasks, *self.pending.values()]:
            task.cancel()

    def _servers(self, healthy_only: bool):
        return [(p, s) for p in (self.pools.ctx, self.pools.gen) for s in p.servers
                if s.healthy or not healthy_only]

    async def _health_loop(self) -> None:
        while True:
            await self.sync()
            # Concurrently: a worker that hangs must not delay the others' verdicts.
            await asyncio.gather(*(self.check(p, s) for p, s in self._servers(False)))
            await asyncio.sleep(self.pools.config.health_check_interval)

    async def _load_loop(self) -> None:
        while True:
            await asyncio.sleep(self.pools.config.load_poll_interval)
            await asyncio.gather(*(self.check(p, s) for p, s in self._servers(True)))

    async def sync(self) -> None:
        """The registry's member list into the pools; kept as it was if it cannot be read."""
        if self.membership is None:
            return
        members = await self.membership.members()
        if members is not None:
            self.pools.sync(members)

    def recheck(self, pool, server) -> None:
        """Check `server` now, unless a recheck of it is under way."""
        if server not in self.pending:
            task = self.pending[server] = asyncio.create_task(self.check(pool, server))
            task.add_done_callback(lambda _: self.pending.pop(server, None))

    async def settle(self, pool) -> bool:
        """Wait (at most a probe's timeout) for the rechecks under way of pool's servers;
        whether there were any."""
        tasks = [t for s, t in self.pending.items() if s in pool.servers]
        if tasks:
            await asyncio.wait(tasks, timeout=PROBE.total)
        return bool(tasks)

    async def check(self, pool, server) -> None:
        """Verified and up, or down (a failed load poll counts: a worker that went is routed
        around at once), and the load it reports."""
        status, instance, body = await challenge(self.pools.session, self.pools.keys,
                                                 server.url)
        creds = server.creds
        if instance is None:
            creds = None
        elif creds is None or creds.instance != instance:
            creds = self.pools.credentials(instance)
        load = None
        if body:
            try:
                load = orjson.loads(body).get("load")
            except (orjson.JSONDecodeError, AttributeError):
                pass
        server.report(load)
        server.creds, server.healthy = creds, body is not None
        self._say(pool, server, "up" if body is not None else
                  f"down: {UNPROVEN}" if status is not None and instance is None else "down")

    def _say(self, pool, server, verdict: str) -> None:
        """Log a server's verdict when it changes (the first one too)."""
        if self.verdicts.get(server) != verdict:
            self.verdicts[server] = verdict
            log = logger.warning if verdict.startswith("down:") else logger.info
            log("orch: %s server %s is %s", pool.name, server.url, verdict)
