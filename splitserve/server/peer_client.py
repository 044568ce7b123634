"""A front-end that shares its worker's engine with other front-ends (`splitserve serve
--api-server-count N`): the serve process owns the engine (server/frontends.py) and tells
this one, over a pipe, when a life of the engine starts, is ready, or died; this one
reports its own metrics back, and hears the other front-ends' reports through it.

The sockets of each life are new ones at new addresses (peer_addresses), as an owning
front-end's are (engine_process.py): whatever a dead engine left unread dies with them,
and closing an old socket can never unlink the file of its successor."""

from __future__ import annotations

import asyncio
import logging
import os
from multiprocessing.connection import Connection

import msgspec
import zmq.asyncio

from splitserve.protocol.engine import EngineReady
from splitserve.protocol.frontends import (
    ControlMessage, EngineDown, EngineStarting, EngineUp, FrontendReport, MetricsState)
from splitserve.server.engine_link import EngineLink
from splitserve.server.engine_process import EngineDeadError, EngineSockets

logger = logging.getLogger(__name__)


def peer_addresses(ipc_dir: str, peer: int, life: int) -> tuple[str, str]:
    """(input, output) socket addresses of front-end `peer` for life `life` of the engine."""
    base = os.path.join(ipc_dir, f"peer{peer}.{life}")
    return f"ipc://{base}-in", f"ipc://{base}-out"


class PeerEngineClient(EngineLink):
    def __init__(self, conn: Connection, ipc_dir: str, peer: int, log_prefix: str,
                 stall_seconds: float = 60.0):
        super().__init__(log_prefix, stall_seconds, peer)
        self.conn, self.ipc_dir = conn, ipc_dir
        self.ctx = zmq.asyncio.Context()
        self.peer_reports: dict[int, FrontendReport] = {}   # the others', by front-end
        self.parent_gone = False
        self._up: asyncio.Future | None = None
        self._decoder = msgspec.msgpack.Decoder(ControlMessage)
        self._encoder = msgspec.msgpack.Encoder()

    process = None    # the engine process is the serve process's child, not this one's

    async def start(self, timeout: float = 300.0) -> EngineReady:
        """Wait until the serve process says the engine is ready."""
        loop = asyncio.get_running_loop()
        self._up = loop.create_future()
        loop.add_reader(self.conn.fileno(), self._on_control)
        try:
            return await asyncio.wait_for(self._up, timeout)
        except asyncio.TimeoutError:
            raise EngineDeadError(f"the engine did not report ready within {timeout:.0f} s") from None

    def _on_control(self) -> None:
        try:
            while self.conn.poll():
                self._control(self._decoder.decode(self.conn.recv_bytes()))
        except (EOFError, OSError):   # the serve process is gone: so is the engine
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
            self.parent_gone = True
            self._fail_all("the worker's serve process stopped")

    def _control(self, msg) -> None:
        if isinstance(msg, FrontendReport):
            if msg.peer != self.peer:   # its own counts it has (absorbed, if it replaced one)
                self.peer_reports[msg.peer] = msg
        elif isinstance(msg, EngineStarting):
            if self.engine is not None:
                self.engine.close()
            self.engine = EngineSockets(self.ctx, *peer_addresses(self.ipc_dir, self.peer, msg.life),
                                        self.log_prefix)
            self.engine.read(self._dispatch)
        elif isinstance(msg, EngineUp):
            self._serving(msg.ready)
            self.restarts = msg.restarts
            if not self._up.done():
                self._up.set_result(msg.ready)
        elif isinstance(msg, EngineDown):
            self._fail_all(msg.reason)

    def report(self, metrics: MetricsState) -> None:
        """Send this front-end's own metrics and in-flight count to the serve process."""
        if not self.parent_gone:
            try:
                self.conn.send_bytes(self._encoder.encode(
                    FrontendReport(self.peer, len(self.queues), metrics)))
            except OSError:
                self.parent_gone = True

    async def shutdown(self, timeout: float = 10.0) -> None:
        self.dead_reason = self.dead_reason or "the worker is shutting down"
        if not self.parent_gone:
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
        if self.engine is not None:
            self.engine.close()
        self.ctx.destroy(linger=0)
