"""`splitserve serve --register ORCH_URL`: the worker keeps itself in an orchestrator's
pools (orchestrator/registry.py's API) while it serves, and leaves when it stops cleanly.

It sends {"role", "url", "ttl"} every ttl/3 seconds (every second while the orchestrator
does not answer, so a worker started before its orchestrator joins as soon as it is up),
with the orchestrator's internal token (internal_client.py: learnt through the challenge on
its /health, learnt again when it restarted), and POST /internal/workers/remove on a clean
stop, before it stops taking connections, so no orchestrator routes to it after it went. A
worker killed outright is removed when its lease lapses (TTL seconds); meanwhile the
orchestrators' health checks route around it. --role ctx registers as a context worker,
gen and agg as generation workers (an agg worker serves whole requests too).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import urllib.request

import msgspec

from splitserve.internal_client import InternalClient
from splitserve.listen import WILDCARDS, http_url
from splitserve.protocol.internal_api import (
    WORKERS_PATH, WORKERS_REMOVE_PATH, Registration as Entry, Removal)
from splitserve.protocol.roles import REGISTERED_ROLE

logger = logging.getLogger(__name__)

TTL = 10.0            # seconds the orchestrator keeps this worker without a heartbeat
RETRY = 1.0           # seconds between tries while the orchestrator does not answer


def own_url(host: str, port: int) -> str:
    """The url the orchestrator reaches this worker at (a wildcard host: this machine's
    name)."""
    return http_url(socket.getfqdn() if host in WILDCARDS else host, port)


class Registration:
    def __init__(self, orchestrator: str, role: str, url: str, secret: str | None,
                 log_prefix: str):
        self.orchestrator = orchestrator.rstrip("/")
        # Without a secret nothing proves the orchestrator: the heartbeats fail and say so.
        self.client = InternalClient(secret or "")
        self.log_prefix = log_prefix
        self.entry = Entry(REGISTERED_ROLE[role], url, TTL)
        self.task = asyncio.create_task(self._heartbeat())

    @classmethod
    def start(cls, config, port: int) -> Registration | None:
        """Heartbeats for a worker serving on `port` (config: server.config.ServerConfig);
        None unless it was given an orchestrator to register with."""
        if not config.register:
            return None
        return cls(config.register, config.role, own_url(config.host, port),
                   config.internal_secret, config.log_prefix)

    @staticmethod
    async def leave(registration: Registration | None) -> None:
        if registration is not None:
            await registration.stop()

    def _post(self, path: str, body: Entry | Removal) -> None:
        req = urllib.request.Request(self.orchestrator + path, msgspec.json.encode(body),
                                     method="POST", headers={"Content-Type": "application/json"})
        with self.client.urlopen(req, timeout=5) as r:
            r.read()

    async def _heartbeat(self) -> None:
        registered = None     # None: not yet; False: failing (said once); True: in the pools
        waited = 0.0          # for an orchestrator that is not listening yet
        while True:
            try:
                await asyncio.to_thread(self._post, WORKERS_PATH, self.entry)
            except OSError as exc:    # urllib's errors (HTTPError: a refusal) are OSErrors
                if registered is None and _gone(exc, ConnectionRefusedError) and waited < TTL:
                    if not waited:    # starting before it (as `up`'s workers do): no warning
                        logger.info("%s: %s does not answer yet; trying every %g s",
                                    self.log_prefix, self.orchestrator, RETRY)
                    waited += RETRY
                elif registered is not False:
                    logger.warning("%s: registering with %s failed (%s); trying every %g s",
                                   self.log_prefix, self.orchestrator, exc, RETRY)
                    registered = False
                await asyncio.sleep(RETRY)
                continue
            if not registered:
                logger.info("%s: registered with %s as %s", self.log_prefix,
                            self.orchestrator, self.entry.url)
            registered = True
            await asyncio.sleep(TTL / 3)

    async def stop(self) -> None:
        """Stop the heartbeats and leave (bounded: a gone orchestrator does not hold up
        the worker's stop)."""
        self.task.cancel()
        try:
            await asyncio.wait_for(asyncio.to_thread(
                self._post, WORKERS_REMOVE_PATH, Removal(self.entry.url)), 6)
            logger.info("%s: left %s", self.log_prefix, self.orchestrator)
        except (OSError, asyncio.TimeoutError) as exc:
            if _gone(exc, (ConnectionRefusedError, ConnectionResetError)):
                # it stopped too (`up` on Ctrl-C signals the whole group): nothing to leave
                logger.info("%s: %s is gone; nothing to leave", self.log_prefix,
                            self.orchestrator)
            else:
                logger.warning("%s: leaving %s failed: %s", self.log_prefix,
                               self.orchestrator, exc)


def _gone(exc: BaseException, kinds) -> bool:
    """The orchestrator is not there: exc, or what urllib wrapped in it, is one of kinds."""
    return isinstance(getattr(exc, "reason", exc), kinds)
