"""The front-end's handle on the engine-core process it owns: start it, and restart it when
it dies; requests go through EngineLink (engine_link.py).

An engine process that exits (a crash, kill -9) is noticed at once (its sentinel): every
request in flight fails with EngineDeadError, a new process starts (crash loops back off),
and until it is ready new requests are refused with it (503).

With several front-ends per worker (server/frontends.py) the serve process owns the engine
through an EngineClient with `peers` (the other front-ends' socket addresses for each life
of the engine) and `on_event`, which hears of each life's start, readiness and death to
pass them on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import zmq
import zmq.asyncio

from splitserve.config import EngineConfig
from splitserve.protocol.engine import EngineReady, Shutdown, pack_input
from splitserve.protocol.frontends import EngineDown, EngineStarting, EngineUp
from splitserve.server.delta_queue import DeltaQueue
from splitserve.server.engine_link import EngineLink
from splitserve.server.engine_process import EngineDeadError, EngineProcess

logger = logging.getLogger(__name__)

__all__ = ["DeltaQueue", "EngineClient", "EngineDeadError"]

STABLE_SECONDS = 60.0         # an engine that served this long before dying restarts at once
BACKOFF_FIRST, BACKOFF_MAX = 1.0, 30.0   # seconds before the 2nd, 3rd, ... restart in a row

PeerAddresses = Callable[[int], list[tuple[str, str]]]   # life -> [(input, output)] per peer


class EngineClient(EngineLink):
    def __init__(self, config: EngineConfig, log_prefix: str = "engine",
                 stall_seconds: float = 60.0, peers: PeerAddresses | None = None,
                 on_event: Callable[[object], None] | None = None):
        super().__init__(log_prefix, stall_seconds)
        self.config = config
        self.peers, self.on_event = peers, on_event
        self.ctx = zmq.asyncio.Context()
        self.engine: EngineProcess | None = None
        self.start_timeout = 300.0
        self._crashes = 0            # deaths in a row, each within STABLE_SECONDS of its start
        self._ready_at = time.monotonic()
        self._closing = False
        self._restarter: asyncio.Task | None = None

    @property
    def process(self):
        """The current engine-core process (multiprocessing.Process), or None."""
        return None if self.engine is None else self.engine.process

    async def start(self, timeout: float = 300.0) -> EngineReady:
        """Spawn the engine process and wait for its handshake."""
        self.start_timeout = timeout
        peers = []
        if self.peers is not None:
            peers = self.peers(self.restarts)
            self._tell(EngineStarting(self.restarts))
        engine = EngineProcess(self.ctx, self.config, self.log_prefix, peers)
        ready = await engine.start(timeout)
        self.engine = engine
        self._serving(ready)
        self._ready_at = time.monotonic()
        engine.serve(self._dispatch, self._on_exit)
        self._tell(EngineUp(ready, self.restarts))
        return ready

    def _tell(self, event) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def _on_exit(self) -> None:
        """The engine process ended: fail what it held and, unless we are stopping, start
        a new one."""
        engine = self.engine
        engine.process.join(5.0)   # its sentinel closes just before it can be reaped
        engine.close()
        if self._closing:
            return
        lived = time.monotonic() - self._ready_at
        self._crashes = self._crashes + 1 if lived < STABLE_SECONDS else 1
        self._fail_all(f"the engine process stopped unexpectedly ({engine.exit_cause()})")
        self._restarter = asyncio.create_task(self._restart())

    def _fail_all(self, reason: str) -> None:
        super()._fail_all(reason)
        self._tell(EngineDown(reason))

    async def _restart(self) -> None:
        """Start engine processes until one is ready: the first at once, then after 1, 2, 4
        ... seconds (at most BACKOFF_MAX) while each dies soon after starting."""
        while not self._closing:
            delay = 0.0 if self._crashes <= 1 else min(
                BACKOFF_FIRST * 2 ** (self._crashes - 2), BACKOFF_MAX)
            self.restarts += 1
            logger.warning("%s: %s; restarting it in %.0f s (restart %d; %d in a row)",
                           self.log_prefix, self.dead_reason, delay, self.restarts, self._crashes)
            await asyncio.sleep(delay)
            try:
                ready = await self.start(self.start_timeout)
            except EngineDeadError as exc:
                self.dead_reason = str(exc)
            except Exception:   # (sockets, spawning) must not end the restarts
                logger.exception("%s: starting an engine process failed", self.log_prefix)
                self.dead_reason = "a new engine process could not be started"
            else:
                logger.warning("%s: engine process restarted; serving again (KV endpoint %s)",
                               self.log_prefix, ready.kv_endpoint or "none")
                return
            self._crashes += 1

    def send(self, message) -> None:
        """An input message from the owner itself (PeerGone), if the engine serves."""
        if self.healthy:
            self.engine.send(pack_input(self._encoder.encode(message)))

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._closing = True
        self.dead_reason = self.dead_reason or "the worker is shutting down"
        if self._restarter is not None:
            self._restarter.cancel()
        engine = self.engine
        if engine is not None and not engine.closed and engine.process.is_alive():
            try:
                engine.in_sock.send(pack_input(self._encoder.encode(Shutdown())), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            deadline = time.monotonic() + timeout
            while engine.process.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        if engine is not None:
            engine.close(kill=True)
        self.ctx.destroy(linger=0)
