"""A worker's graceful stop (SIGTERM): it hands its work on instead of cutting it off.

`WorkerServer.stop` runs `drain` after leaving the orchestrator (registration.py) and before
it stops taking connections:

1. The worker is draining: a new generation request is refused with 503 and Retry-After
   (the orchestrator tries another worker), and /health answers 503 "draining".
2. Once another generation worker can take its streams (the orchestrator it registered with
   reports a healthy one besides this worker; a worker that did not register assumes its
   orchestrator has one), the engine is asked to hand off (protocol `Drain`): each stream
   the orchestrator can continue (`EngineRequest.movable`) ends at the next step boundary
   with its KV leased, and its response with the handoff comment (protocol/disagg.py);
   the orchestrator continues it on another worker, which pulls that KV as from a context
   worker. The rest (whole responses, streams reading prompt values, a context worker's
   prefills) run to their end.
3. It waits until nothing is in flight and then until every lease was pulled (for at
   most LEASE_WAIT more: a lease nobody pulled by then has no one coming for it), at most
   `drain_grace_seconds` from the signal in all; whatever is still open then is cut off as
   before (the orchestrator continues a cut stream by recomputing it elsewhere).
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.error
import urllib.request

import orjson

from splitserve.server.registration import own_url

logger = logging.getLogger(__name__)

POLL = 0.05             # seconds between looks at what is still open
PEER_POLL = 0.5         # seconds between asking the orchestrator for another worker
LEASE_WAIT = 3.0        # seconds leases are waited for once no request is in flight


async def drain(server, grace: float) -> None:
    """server: a WorkerServer, already out of its orchestrator's pools."""
    server.draining = True
    deadline = time.monotonic() + grace
    handed_off, asked = False, 0.0
    logger.info("%s: draining: %d request(s) in flight, %d KV block(s) leased (grace %g s)",
                server.log_prefix, server.handlers.in_flight,
                server.engine.stats.kv_blocks_leased, grace)
    while server.handlers.in_flight and time.monotonic() < deadline:
        now = time.monotonic()
        if not handed_off and now - asked >= PEER_POLL:
            asked = now
            if await _another_worker(server):
                server.engine.drain()
                handed_off = True
        await asyncio.sleep(POLL)
    deadline = min(deadline, time.monotonic() + LEASE_WAIT)
    while _leased(server) and time.monotonic() < deadline:
        await asyncio.sleep(POLL)
    left = server.handlers.in_flight
    if left or server.engine.stats.kv_blocks_leased:
        logger.warning("%s: drain grace of %g s over: %d request(s) still in flight, %d KV "
                       "block(s) leased", server.log_prefix, grace, left,
                       server.engine.stats.kv_blocks_leased)


def _leased(server) -> bool:
    return server.engine.healthy and server.engine.stats.kv_blocks_leased > 0


async def _another_worker(server) -> bool:
    """Whether a generation worker besides this one takes requests now, as the
    orchestrator it registered with says (one it did not register with: assumed)."""
    orchestrator = server.config.register
    if not orchestrator:
        return True
    own = own_url(server.config.host, server.http.port)
    try:
        healthy = await asyncio.to_thread(_healthy_generation, orchestrator.rstrip("/"))
    except (OSError, ValueError) as exc:
        logger.info("%s: draining: the orchestrator's /health: %s", server.log_prefix, exc)
        return False
    return any(url.rstrip("/") != own for url in healthy)


def _healthy_generation(orchestrator: str) -> list[str]:
    """The orchestrator's healthy generation workers (its /health, which answers 503 when a
    pool is empty, with the same body)."""
    try:
        with urllib.request.urlopen(orchestrator + "/health", timeout=1) as r:
            raw = r.read(1 << 20)
    except urllib.error.HTTPError as exc:
        raw = exc.read(1 << 20)
    body = orjson.loads(raw)
    urls = (body.get("healthy") or {}).get("gen") if isinstance(body, dict) else None
    return [u for u in urls if isinstance(u, str)] if isinstance(urls, list) else []
