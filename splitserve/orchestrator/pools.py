"""A pool of workers of one role, and one request's tries on the pools."""

from __future__ import annotations

import logging

from splitserve.orchestrator.cluster import Server
from splitserve.orchestrator.relay import UpstreamError
from splitserve.orchestrator.routers import make_router
from splitserve.orchestrator.upstream import Retry

logger = logging.getLogger(__name__)

ROLE = {"ctx": "context", "gen": "generation"}


class Pool:
    def __init__(self, name: str, urls, router: str):
        self.name = name
        self.servers = [Server(u.rstrip("/")) for u in urls]
        self.router = make_router(router)

    def pick(self, key: bytes, avoid=()) -> Server | None:
        """A healthy server, one not in `avoid` if there is one."""
        healthy = [s for s in self.servers if s.healthy]
        fresh = [s for s in healthy if s not in avoid] if avoid else healthy
        candidates = fresh or healthy
        return self.router.pick(candidates, key) if candidates else None

    def mark_down(self, url: str) -> None:
        for s in self.servers:
            if s.url == url and s.healthy:
                logger.info("orch: %s server %s is down", self.name, url)
                s.healthy = False


class Tries:
    """One request's tries: per pool, the servers that failed it (tried again only when no
    other is healthy) and how many more failures it survives."""

    def __init__(self, max_retries: int, retries_metric):
        self.max_retries, self.metric = max_retries, retries_metric
        self.failed: dict[str, list[Server]] = {"ctx": [], "gen": []}

    def pick(self, pool: Pool, key: bytes) -> Server:
        server = pool.pick(key, self.failed[pool.name])
        if server is None:
            raise UpstreamError(f"no {ROLE[pool.name]} worker is available; retry later")
        return server

    def failed_on(self, pool: Pool, server: Server, exc: Retry) -> None:
        """Note the failure; UpstreamError once the pool has failed too often."""
        failed = self.failed[pool.name]
        failed.append(server)
        if exc.down:
            pool.mark_down(server.url)
        if len(failed) > self.max_retries:
            logger.warning("orch: %s server %s failed (%s); giving up after %d tries",
                           pool.name, server.url, exc, len(failed))
            raise UpstreamError(f"no {ROLE[pool.name]} worker could serve this request "
                                f"({len(failed)} tries failed); retry later")
        logger.warning("orch: %s server %s failed (%s); trying again", pool.name, server.url, exc)
        self.metric.labels(pool.name, exc.reason).inc()
