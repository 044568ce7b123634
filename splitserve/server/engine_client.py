"""The front-end's handle on its engine-core process: start it, submit, stream, abort.

A callback on the output socket's file descriptor routes each CompletionDelta to the
queue of its request. Requests go out batched: everything submitted during one event-loop
turn leaves in one AddRequests message at the end of the turn, with the prompts as raw int32
bytes in the same frame, so a burst of arrivals costs one ZeroMQ send, not one each.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing
import os
import tempfile
import time
import uuid
from typing import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from splitserve.config import EngineConfig
from splitserve.engine.process import run_engine_core
from splitserve.engine.request import FinishReason
from splitserve.protocol.engine import (
    AbortRequests, AddRequest, AddRequests, CompletionDelta, EngineDead, EngineOutput, EngineOutputs,
    EngineReady, EngineStats, RemotePrefill, Shutdown, pack_input)
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class DeltaQueue:
    """One request's deltas: what asyncio.Queue does for a single consumer, unbounded,
    without its bookkeeping. Not eager (a response sent whole): the consumer is woken only
    when a sequence finishes, not once per engine step, and then drains every delta."""

    __slots__ = ("_items", "_waiter", "_eager")

    def __init__(self, eager: bool = True):
        self._items: collections.deque[CompletionDelta] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._eager = eager

    def put_nowait(self, delta: CompletionDelta) -> None:
        self._items.append(delta)
        if (self._waiter is not None and (self._eager or delta.finish_reason is not None)
                and not self._waiter.done()):
            self._waiter.set_result(None)

    async def get(self) -> CompletionDelta:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class EngineClient:
    def __init__(self, config: EngineConfig, log_prefix: str = "engine"):
        self.config = config
        self.log_prefix = log_prefix
        base = os.path.join(tempfile.gettempdir(), f"splitserve-{uuid.uuid4().hex[:12]}")
        self.input_addr, self.output_addr = f"ipc://{base}-in", f"ipc://{base}-out"
        self.ctx = zmq.asyncio.Context()
        self.queues: dict[str, DeltaQueue] = {}
        self.ready: EngineReady | None = None
        self.stats = EngineStats(0, 0, 0, 0, 0, 0)
        self.dead_reason: str | None = None
        self.process: multiprocessing.Process | None = None
        self._tasks: list[asyncio.Task] = []
        self._reader_fd: int | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._outbox: list[tuple[AddRequest, memoryview | bytes]] = []

    @property
    def healthy(self) -> bool:
        return self.ready is not None and self.dead_reason is None

    async def start(self, timeout: float = 300.0) -> EngineReady:
        """Spawn the engine process and wait for its handshake."""
        # Sends are synchronous and never block (no high-water mark; the engine's reader
        # thread drains the socket), so they need no future and no await.
        self._in_async = self.ctx.socket(zmq.PUSH)   # owns the socket; in_sock shadows it
        self.in_sock = zmq.Socket.shadow(self._in_async.underlying)
        self.in_sock.setsockopt(zmq.SNDHWM, 0)
        self.in_sock.bind(self.input_addr)
        self.out_sock = self.ctx.socket(zmq.PULL)
        self.out_sock.bind(self.output_addr)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name=f"{self.log_prefix}-core", daemon=True,
            args=(self.config, self.input_addr, self.output_addr, self.log_prefix))
        self.process.start()
        decoder = msgspec.msgpack.Decoder(EngineOutput)
        try:
            first = decoder.decode(await asyncio.wait_for(self.out_sock.recv(), timeout))
        except asyncio.TimeoutError:
            self.process.kill()
            raise EngineDeadError(f"engine did not report ready within {timeout:.0f} s") from None
        if isinstance(first, EngineDead):
            raise EngineDeadError(first.reason)
        self.ready = first
        self._start_reader(decoder)
        self._tasks = [asyncio.create_task(self._watch_process())]
        return first

    def _start_reader(self, decoder) -> None:
        """Engine outputs are read by a callback on the socket's file descriptor, not by
        awaiting pyzmq futures: one wake-up drains every message that arrived. ZeroMQ's
        descriptor is edge-triggered, so each wake-up reads until nothing is left."""
        sock = zmq.Socket.shadow(self.out_sock.underlying)

        def on_readable() -> None:
            try:
                while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    self._dispatch(decoder.decode(sock.recv(zmq.NOBLOCK)))
            except Exception:   # a bad message must not stop the reader
                logger.exception("%s: engine output dropped", self.log_prefix)
        loop = asyncio.get_running_loop()
        self._reader_fd = sock.getsockopt(zmq.FD)
        loop.add_reader(self._reader_fd, on_readable)
        loop.call_soon(on_readable)   # what arrived before the reader was registered

    def _dispatch(self, msg) -> None:
        if isinstance(msg, EngineOutputs):
            self.stats = msg.stats
            now = time.time()
            for delta in msg.deltas:
                q = self.queues.get(delta.request_id)
                if q is not None:
                    delta.received = now   # latency metrics use this, not when it is read
                    q.put_nowait(delta)
        elif isinstance(msg, EngineDead):
            self._fail_all(msg.reason)

    async def _watch_process(self) -> None:
        while self.process.is_alive():
            await asyncio.sleep(0.5)
        self._fail_all(f"engine process exited with code {self.process.exitcode}")

    def _fail_all(self, reason: str) -> None:
        if self.dead_reason is None:
            logger.error("%s: engine is dead: %s", self.log_prefix, reason)
        self.dead_reason = reason
        for rid, q in self.queues.items():
            q.put_nowait(CompletionDelta(rid, -1, [], "", finish_reason=int(FinishReason.ERROR),
                                         error=f"engine is not running: {reason}"))

    # -- requests -------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: PromptTokens, params: SamplingParams,
                       context_only: bool = False, remote: RemotePrefill | None = None,
                       stream: bool = True,
                       resumed: PromptTokens | None = None) -> AsyncIterator[CompletionDelta]:
        """Yields the request's deltas until all n sequences finished; stream=False yields
        them in bursts, when a sequence finishes. Leaving early (the client went away, the
        task was cancelled) aborts the request in the engine. resumed: output tokens already
        streamed by another worker (mid-stream migration); they ride after the prompt."""
        if not self.healthy:
            raise EngineDeadError(self.dead_reason or "engine not started")
        q = self.queues[request_id] = DeltaQueue(eager=stream)
        frame = b"" if prompt.is_placeholder else memoryview(prompt.array).cast("B")
        n_resumed = 0 if resumed is None else len(resumed)
        if n_resumed:
            frame = bytes(frame) + memoryview(resumed.array).cast("B")
        msg = AddRequest(request_id, params, len(prompt) + n_resumed, prompt.is_placeholder,
                         context_only, remote, stream, n_resumed)
        open_seqs = params.n
        try:
            self._submit(msg, frame)
            while open_seqs:
                delta = await q.get()
                if delta.finish_reason is not None:
                    open_seqs = 0 if delta.index < 0 or delta.error_param is not None else open_seqs - 1
                yield delta
        finally:
            self.queues.pop(request_id, None)
            if open_seqs and self.healthy:
                await self.abort([request_id])

    def _submit(self, msg: AddRequest, frame: memoryview | bytes) -> None:
        self._outbox.append((msg, frame))
        if len(self._outbox) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        if batch:
            header = self._encoder.encode(AddRequests([msg for msg, _ in batch]))
            self.in_sock.send(pack_input(header, [frame for _, frame in batch]),
                              copy=False)

    async def abort(self, request_ids: list[str]) -> None:
        self._flush()   # an abort must not overtake the request it aborts
        self.in_sock.send(pack_input(self._encoder.encode(AbortRequests(request_ids))))

    async def shutdown(self, timeout: float = 10.0) -> None:
        for task in self._tasks:
            task.cancel()
        if self._reader_fd is not None:
            asyncio.get_running_loop().remove_reader(self._reader_fd)
            self._reader_fd = None
        if self.process is not None and self.process.is_alive():
            try:
                self.in_sock.send(pack_input(self._encoder.encode(Shutdown())), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            deadline = time.monotonic() + timeout
            while self.process.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self.process.is_alive():
                self.process.kill()
        self.ctx.destroy(linger=0)
        for addr in (self.input_addr, self.output_addr):
            try:
                os.unlink(addr.removeprefix("ipc://"))
            except FileNotFoundError:
                pass
