"""`splitserve serve --api-server-count N`: N HTTP front-end processes on one port, over
one engine process.

The serve process serves no HTTP: it owns the engine (an EngineClient with `peers`: it
spawns the engine, and restarts it when it dies, as a lone front-end does) and the N
front-ends (children it restarts when one dies). Each front-end has its own pair of
ZeroMQ sockets to the engine, which routes every request's outputs back to the front-end
that sent it (engine/output_router.py) and its stats to all of them. Over one pipe per
front-end the serve process tells each when a life of the engine starts, is ready, or has
died (in-flight requests fail with EngineDeadError, new ones get 503 until it is back), and
passes each front-end's metrics reports on to the others (/metrics and /health give the
worker's totals on any of them). A front-end that dies takes nothing else down: the engine
is told (PeerGone) and aborts its requests, freeing their KV blocks; a new front-end takes
its place and carries on its counters. Stopping serve (SIGINT, SIGTERM) stops every
front-end, then the engine; if the serve process itself is killed, the engine (its parent
gone) and the front-ends (their pipe closed) stop by themselves.

Why SO_REUSEPORT: every front-end listens on host:port with its own socket and the kernel
spreads new connections over them (a hash of the connection's addresses), so no process
hands accepted sockets out (one more hop, and one process every connection crosses) and a
dead front-end's socket simply leaves the group. The serve process binds the port first
(without listening: it gets no connections) so that the port is taken, and port 0 means
one port for all. Spreading is per connection, not per request: a few long keep-alive
connections can load the front-ends unevenly; clients that open many spread evenly.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import socket
import tempfile
import time
from dataclasses import replace

import msgspec

from splitserve.protocol.engine import PeerGone
from splitserve.protocol.frontends import ControlMessage, EngineStarting, EngineUp
from splitserve.server.config import ServerConfig
from splitserve.server.engine_client import EngineClient
from splitserve.server.peer_client import peer_addresses
from splitserve.signals import wait_for_stop_signal

logger = logging.getLogger(__name__)

RESTART_DELAY, RESTART_DELAY_MAX = 1.0, 30.0   # seconds before a dead front-end's successor
STABLE_SECONDS = 60.0     # a front-end that lived this long restarts after the first delay


def _frontend_main(config: ServerConfig, peer: int, ipc_dir: str, conn, inherited) -> None:
    from splitserve import envs, redact
    from splitserve.server.app import WorkerServer, run_loop
    from splitserve.server.peer_client import PeerEngineClient
    logging.basicConfig(level=envs.log_level(), format="%(asctime)s %(levelname)s %(message)s")
    redact.install(config.internal_secret)
    engine = PeerEngineClient(conn, ipc_dir, peer, f"{config.log_prefix}/{peer}",
                              config.engine_stall_seconds)
    server = WorkerServer(config, engine)
    server.metrics.absorb(inherited)
    run_loop(server.run())


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port with SO_REUSEPORT, not listening: the port is taken
    (and chosen, for port 0) for the front-ends, who bind it the same way."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class _Child:
    def __init__(self, process, conn):
        self.process, self.conn, self.started = process, conn, time.monotonic()


class Frontends:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.numbers = range(1, config.api_server_count + 1)   # the engine's peer 0 is us
        self.log_prefix = config.log_prefix
        self.ipc_dir = tempfile.mkdtemp(prefix="splitserve-")
        self.engine = EngineClient(
            config.engine, self.log_prefix, config.engine_stall_seconds,
            peers=lambda life: [peer_addresses(self.ipc_dir, k, life) for k in self.numbers],
            on_event=self._broadcast)
        self.children: dict[int, _Child] = {}
        self.reports: dict[int, bytes] = {}     # each front-end's last report, encoded
        self.state: dict[type, bytes] = {}      # the last EngineStarting, and EngineUp/Down
        self.deaths: dict[int, int] = {}        # early deaths in a row, per front-end
        self.closing = False
        self.port = config.port
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ControlMessage)

    async def run(self) -> None:
        listener = reserve_port(self.config.host, self.config.port)
        self.port = listener.getsockname()[1]   # port 0: the one chosen, for every front-end
        try:
            for peer in self.numbers:   # they read the tokenizer while the engine starts
                self._spawn(peer, {})
            await self.engine.start(self.config.engine_start_timeout)
            logger.info("%s: %d front-end processes serving on http://%s:%d (SO_REUSEPORT)",
                        self.log_prefix, len(self.numbers), self.config.host, self.port)
            await wait_for_stop_signal()
        finally:
            await self.stop()
            listener.close()

    def _broadcast(self, event) -> None:
        """An engine event (EngineStarting, EngineUp, EngineDown) to every front-end."""
        frame = self._encoder.encode(event)
        self.state[EngineStarting if isinstance(event, EngineStarting) else EngineUp] = frame
        for child in self.children.values():
            _send(child, frame)

    def _spawn(self, peer: int, inherited: dict) -> None:
        ours, theirs = multiprocessing.Pipe()
        process = multiprocessing.get_context("spawn").Process(
            target=_frontend_main, name=f"{self.log_prefix}-frontend{peer}", daemon=True,
            args=(replace(self.config, port=self.port), peer, self.ipc_dir, theirs, inherited))
        process.start()
        theirs.close()
        child = self.children[peer] = _Child(process, ours)
        others = [frame for k, frame in self.reports.items() if k != peer]
        for frame in [*self.state.values(), *others]:   # catch it up
            _send(child, frame)
        loop = asyncio.get_running_loop()
        loop.add_reader(ours.fileno(), self._on_report, peer)
        loop.add_reader(process.sentinel, self._on_exit, peer)

    def _on_report(self, peer: int) -> None:
        """Pass a front-end's metrics report on to the others; keep it for a successor."""
        child = self.children[peer]
        try:
            while child.conn.poll():
                frame = child.conn.recv_bytes()
                self.reports[peer] = frame
                for other, c in list(self.children.items()):
                    if other != peer:
                        _send(c, frame)
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(child.conn.fileno())

    def _on_exit(self, peer: int) -> None:
        """A front-end died: its requests are aborted in the engine, a new one starts."""
        child = self.children.pop(peer)
        loop = asyncio.get_running_loop()
        loop.remove_reader(child.process.sentinel)
        try:
            loop.remove_reader(child.conn.fileno())
        except (OSError, ValueError):
            pass
        child.process.join(5.0)
        child.conn.close()
        if self.closing:
            return
        self.engine.send(PeerGone(peer))
        lived = time.monotonic() - child.started
        self.deaths[peer] = self.deaths.get(peer, 0) + 1 if lived < STABLE_SECONDS else 1
        delay = min(RESTART_DELAY * 2 ** (self.deaths[peer] - 1), RESTART_DELAY_MAX)
        logger.error("%s: front-end %d (pid %d) stopped unexpectedly (exit code %s); its "
                     "requests are aborted; a new one starts in %.0f s", self.log_prefix, peer,
                     child.process.pid, child.process.exitcode, delay)
        inherited = {}
        if peer in self.reports:   # its counters carry on; nothing of it is in flight
            report = self._decoder.decode(self.reports[peer])
            inherited = report.metrics
            self.reports[peer] = self._encoder.encode(
                msgspec.structs.replace(report, in_flight=0))
            for c in self.children.values():
                _send(c, self.reports[peer])
        loop.call_later(delay, self._respawn, peer, inherited)

    def _respawn(self, peer: int, inherited: dict) -> None:
        if not self.closing and peer not in self.children:
            self._spawn(peer, inherited)

    async def stop(self, timeout: float = 15.0) -> None:
        """Every front-end (SIGTERM: each finishes what it answers, up to its grace), then
        the engine."""
        self.closing = True
        for child in self.children.values():
            child.process.terminate()
        deadline = time.monotonic() + timeout
        while any(c.process.is_alive() for c in self.children.values()) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for peer in list(self.children):
            if self.children[peer].process.is_alive():
                self.children[peer].process.kill()
            self._on_exit(peer)
        await self.engine.shutdown()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _send(child: _Child, frame: bytes) -> None:
    try:
        child.conn.send_bytes(frame)
    except OSError:   # it is dying; its sentinel tells
        pass


def serve_frontends(config: ServerConfig) -> None:
    from splitserve.server.app import run_loop
    run_loop(Frontends(config).run())
