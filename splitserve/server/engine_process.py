"""One life of the front-end's engine-core process: its two ZeroMQ sockets (EngineSockets,
which every front-end of a worker has), the spawned process, the start-up handshake, its
exit, and sends that never block the event loop.

A restart makes a new EngineProcess (new socket addresses): whatever the dead process had
not read, and whatever it had sent but the front-end had not, dies with the old sockets.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing
import os
import signal
import tempfile
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from splitserve.config import EngineConfig
from splitserve.protocol.engine import EngineDead, EngineOutput, EngineReady

logger = logging.getLogger(__name__)

SEND_RETRY_SECONDS = 0.005


def _engine_main(*args) -> None:
    """The spawned process's entry point: the engine (torch, the model) is imported there,
    never in the front-end, which needs none of it."""
    from splitserve.engine.process import run_engine_core
    run_engine_core(*args)


class EngineDeadError(RuntimeError):
    """The engine process stopped, or is not serving yet: the request gets a 503."""


class EngineSockets:
    """A front-end's pair of sockets to the engine process, for one life of it: it binds
    both, the engine connects. Each front-end of a worker has its own pair."""

    def __init__(self, ctx: zmq.asyncio.Context, input_addr: str, output_addr: str,
                 log_prefix: str):
        self.input_addr, self.output_addr = input_addr, output_addr
        self.log_prefix = log_prefix
        self._in_async = ctx.socket(zmq.PUSH)   # owns the socket; in_sock shadows it
        # Sends are synchronous (no future, no await); see send().
        self.in_sock = zmq.Socket.shadow(self._in_async.underlying)
        self.in_sock.setsockopt(zmq.SNDHWM, 0)
        self.in_sock.bind(self.input_addr)
        self.out_sock = ctx.socket(zmq.PULL)
        self.out_sock.bind(self.output_addr)
        self.decoder = msgspec.msgpack.Decoder(EngineOutput)
        self._unsent: collections.deque[bytes] = collections.deque()
        self._retry: asyncio.TimerHandle | None = None
        self._watched: list[int] = []            # file descriptors with a reader on the loop
        self.closed = False

    def read(self, on_output: Callable) -> None:
        """From now on every decoded output message goes to on_output.

        Outputs are read by a callback on the socket's file descriptor, not by awaiting pyzmq
        futures: one wake-up drains every message that arrived. ZeroMQ's descriptor is
        edge-triggered, so each wake-up reads until nothing is left."""
        sock, decoder = zmq.Socket.shadow(self.out_sock.underlying), self.decoder

        def on_readable() -> None:
            try:
                while not self.closed and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    on_output(decoder.decode(sock.recv(zmq.NOBLOCK)))
            except Exception:   # a bad message must not stop the reader
                logger.exception("%s: engine output dropped", self.log_prefix)
        self._watch(sock.getsockopt(zmq.FD), on_readable)
        asyncio.get_running_loop().call_soon(on_readable)   # what arrived before the reader

    def send(self, frame: bytes) -> None:
        """Queue a pack_input frame and send what is queued, in order, without blocking:
        until the engine's input thread has connected (just after the handshake) a send
        would wait, so the frames wait here and are tried again shortly."""
        self._unsent.append(frame)
        if self._retry is None:
            self._send_unsent()

    def _send_unsent(self) -> None:
        self._retry = None
        while self._unsent and not self.closed:
            try:
                self.in_sock.send(self._unsent[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._retry = asyncio.get_running_loop().call_later(
                    SEND_RETRY_SECONDS, self._send_unsent)
                return
            self._unsent.popleft()

    def close(self) -> None:
        """Stop reading and sending and close the sockets (unsent frames are dropped)."""
        if self.closed:
            return
        self.closed = True
        self._unwatch()
        if self._retry is not None:
            self._retry.cancel()
        self._unsent.clear()
        self._in_async.close(linger=0)
        self.out_sock.close(linger=0)
        for addr in (self.input_addr, self.output_addr):
            try:
                os.unlink(addr.removeprefix("ipc://"))
            except FileNotFoundError:
                pass

    def _watch(self, fd: int, callback: Callable[[], None]) -> None:
        asyncio.get_running_loop().add_reader(fd, callback)
        self._watched.append(fd)

    def _unwatch(self) -> None:
        loop = asyncio.get_running_loop()
        for fd in self._watched:
            loop.remove_reader(fd)
        self._watched.clear()


class EngineProcess(EngineSockets):
    """The engine process and the sockets of the front-end that owns it (spawns, watches,
    restarts it). `peers`: the (input, output) addresses of the worker's other front-ends
    (`serve --api-server-count N`; server/frontends.py), which the engine connects to too."""

    def __init__(self, ctx: zmq.asyncio.Context, config: EngineConfig, log_prefix: str,
                 peers: list[tuple[str, str]] = ()):
        # A directory only this user may enter (0700): no other local user can connect to
        # the engine's sockets and feed it requests.
        self.ipc_dir = tempfile.mkdtemp(prefix="splitserve-")
        base = os.path.join(self.ipc_dir, "engine")
        super().__init__(ctx, f"ipc://{base}-in", f"ipc://{base}-out", log_prefix)
        if peers:
            addrs = ([self.input_addr, *(i for i, _ in peers)],
                     [self.output_addr, *(o for _, o in peers)])
        else:
            addrs = (self.input_addr, self.output_addr)
        self.process = multiprocessing.get_context("spawn").Process(
            target=_engine_main, name=f"{log_prefix}-core", daemon=True,
            args=(config, *addrs, log_prefix, os.getpid()))

    async def start(self, timeout: float) -> EngineReady:
        """Spawn the process and wait for its handshake; EngineDeadError (and everything
        closed) if it reports a failure, exits first, or does not answer within `timeout`."""
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        recv = asyncio.ensure_future(self.out_sock.recv())
        try:
            self.process.start()
            self._watch(self.process.sentinel, lambda: exited.done() or exited.set_result(None))
            await asyncio.wait((recv, exited), timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
            if recv.done():
                first = self.decoder.decode(recv.result())
                if isinstance(first, EngineDead):
                    raise EngineDeadError(first.reason)
                return first
            if exited.done():
                raise EngineDeadError(f"the engine process stopped during start-up "
                                      f"({self.exit_cause()})")
            raise EngineDeadError(f"the engine did not report ready within {timeout:.0f} s")
        except BaseException:
            recv.cancel()
            self.close(kill=True)
            raise
        finally:
            self._unwatch()

    def serve(self, on_output: Callable, on_exit: Callable[[], None]) -> None:
        """Read outputs (EngineSockets.read); on_exit runs once the process has ended (its
        sentinel is readable: at once, not at the next poll)."""
        self.read(on_output)
        self._watch(self.process.sentinel, on_exit)

    def exit_cause(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"signal {-code}, {signal.Signals(-code).name}"
            except ValueError:
                return f"signal {-code}"
        return f"exit code {code}"

    def close(self, kill: bool = False) -> None:
        """Close the sockets and, with kill, SIGKILL the process if it still runs."""
        if self.closed:
            return
        if kill and self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        if self.process.pid is not None and not self.process.is_alive():
            self.process.join()   # reaped: no zombie
        super().close()
        try:
            os.rmdir(self.ipc_dir)
        except OSError:
            pass
