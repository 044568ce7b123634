"""Watching the workers: health checks (every health_check_interval, every server of both
pools), the faster load poll (every load_poll_interval, the healthy ones), and, before each
round of health checks, the pools' registered members read from the registry
(orchestrator/registry.py).

Both probes are GET /health: its 200 says the worker serves, its "load" object what it
holds (Server.report). The load poll costs a worker one small request per orchestrator
process per interval (measured in docs/reliability.md's orchestrator section)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import orjson

from splitserve.orchestrator.upstream import read_at_most

logger = logging.getLogger(__name__)

PROBE = aiohttp.ClientTimeout(total=2.0)   # health checks, load polls and /v1/models
PROBE_MAX_BYTES = 1 << 20                   # a /health or /v1/models body past this: garbage


class Probes:
    def __init__(self, pools):
        self.pools = pools          # pools.Pools: its session, config and both pools
        self.membership = None
        self.tasks: list[asyncio.Task] = []

    def start(self, membership=None) -> None:
        """membership: registry.LocalMembership or RemoteMembership (None: static only)."""
        self.membership = membership
        self.tasks = [asyncio.create_task(self._health_loop())]
        if self.pools.config.load_poll_interval > 0:
            self.tasks.append(asyncio.create_task(self._load_loop()))

    def stop(self) -> None:
        for task in self.tasks:
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

    async def check(self, pool, server) -> None:
        """Up or down (a failed load poll counts: a worker that went is routed around at
        once), and the load it reports."""
        body = b""
        try:
            async with self.pools.session.get(server.url + "/health", timeout=PROBE) as r:
                healthy = r.status == 200
                if healthy:
                    body = await read_at_most(r, PROBE_MAX_BYTES)
                    healthy = body is not None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            healthy = False
        if body:
            try:
                server.report(orjson.loads(body).get("load"))
            except (orjson.JSONDecodeError, AttributeError):
                pass
        if healthy != server.healthy:
            logger.info("orch: %s server %s is %s", pool.name, server.url,
                        "up" if healthy else "down")
        server.healthy = healthy
