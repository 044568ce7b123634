"""The front-end's handle on its engine-core process: start it, submit, stream, abort, and
restart it when it dies.

A callback on the output socket's file descriptor routes each CompletionDelta to the
queue of its request. Requests go out batched: everything submitted during one event-loop
turn leaves in one AddRequests message at the end of the turn, with the prompts as raw int32
bytes in the same frame, so a burst of arrivals costs one ZeroMQ send, not one each.

An engine process that exits (a crash, kill -9) is noticed at once (its sentinel): every
request in flight fails with EngineDeadError, a new process starts (crash loops back off),
and until it is ready new requests are refused with it (503).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import AsyncIterator

import msgspec
import zmq.asyncio

from splitserve.config import EngineConfig
from splitserve.protocol.engine import (
    AbortRequests, AddRequests, CompletionDelta, EngineDead, EngineOutputs, EngineReady,
    EngineRequest, EngineStats, KVBlocks, Shutdown, pack_input)
from splitserve.server.engine_process import EngineDeadError, EngineProcess
from splitserve.tokens import PromptTokens

logger = logging.getLogger(__name__)

__all__ = ["DeltaQueue", "EngineClient", "EngineDeadError"]

STABLE_SECONDS = 60.0         # an engine that served this long before dying restarts at once
BACKOFF_FIRST, BACKOFF_MAX = 1.0, 30.0   # seconds before the 2nd, 3rd, ... restart in a row


class DeltaQueue:
    """One request's deltas: what asyncio.Queue does for a single consumer, unbounded,
    without its bookkeeping. Not eager (a response sent whole): the consumer is woken only
    when a sequence finishes, not once per engine step, and then drains every delta."""

    __slots__ = ("_items", "_waiter", "_eager", "_error")

    def __init__(self, eager: bool = True):
        self._items: collections.deque[CompletionDelta] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._eager = eager
        self._error: str | None = None

    def put_nowait(self, delta: CompletionDelta) -> None:
        self._items.append(delta)
        if (self._waiter is not None and (self._eager or delta.finish_reason is not None)
                and not self._waiter.done()):
            self._waiter.set_result(None)

    def fail(self, message: str) -> None:
        """get() raises EngineDeadError(message) once the deltas already queued are taken."""
        self._error = message
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> CompletionDelta:
        while not self._items:
            if self._error is not None:
                raise EngineDeadError(self._error)
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class EngineClient:
    def __init__(self, config: EngineConfig, log_prefix: str = "engine",
                 stall_seconds: float = 60.0):
        self.config = config
        self.log_prefix = log_prefix
        self.stall_seconds = stall_seconds     # no step this long while holding work: stuck
        self.ctx = zmq.asyncio.Context()
        self.queues: dict[str, DeltaQueue] = {}
        self.ready: EngineReady | None = None
        self.stats = EngineStats(0, 0, 0, 0, 0, 0)
        self.kv_blocks: KVBlocks | None = None   # the engine's last prefix cache report
        self.dead_reason: str | None = None    # set while the engine is down (restarting)
        self.engine: EngineProcess | None = None
        self.restarts = 0
        self.start_timeout = 300.0
        self._crashes = 0            # deaths in a row, each within STABLE_SECONDS of its start
        self._ready_at = self._last_step = time.monotonic()
        self._closing = False
        self._restarter: asyncio.Task | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._outbox: list[tuple[EngineRequest, memoryview | bytes]] = []

    @property
    def process(self):
        """The current engine-core process (multiprocessing.Process), or None."""
        return None if self.engine is None else self.engine.process

    @property
    def healthy(self) -> bool:
        """Takes requests: started and not dead or restarting."""
        return self.ready is not None and self.dead_reason is None

    def check_available(self) -> None:
        """EngineDeadError unless new requests can be taken now."""
        if self.ready is None:
            raise EngineDeadError("the engine is starting; retry shortly")
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine is restarting ({self.dead_reason}); retry shortly")

    def health(self) -> str | None:
        """None while the engine serves; else why it does not (for /health): it is starting
        or restarting, its KV transport stopped, or it holds work and completed no step for
        stall_seconds (the engine process sends its step count at least twice a second, so
        only a stuck process, or a single step longer than stall_seconds, stands still)."""
        try:
            self.check_available()
        except EngineDeadError as exc:
            return str(exc)
        if self.stats.kv_error:
            return self.stats.kv_error
        still = time.monotonic() - self._last_step
        if still > self.stall_seconds and (self.queues or self.stats.num_running
                                           or self.stats.num_waiting):
            return (f"the engine is stalled: no step completed for {still:.0f} s while it "
                    f"holds requests")
        return None

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not finished that the engine is not running (as of its
        last stats): what load shedding bounds."""
        return max(len(self.queues) - self.stats.num_running, 0)

    async def start(self, timeout: float = 300.0) -> EngineReady:
        """Spawn the engine process and wait for its handshake."""
        self.start_timeout = timeout
        engine = EngineProcess(self.ctx, self.config, self.log_prefix)
        ready = await engine.start(timeout)
        self.engine, self.ready, self.dead_reason = engine, ready, None
        self.stats = EngineStats(0, 0, 0, ready.num_blocks, 0, 0)
        self.kv_blocks = None
        self._ready_at = self._last_step = time.monotonic()
        engine.serve(self._dispatch, self._on_exit)
        return ready

    def _dispatch(self, msg) -> None:
        if isinstance(msg, EngineOutputs):
            if msg.stats.steps != self.stats.steps:
                self._last_step = time.monotonic()
            self.stats = msg.stats
            now = time.time()
            for delta in msg.deltas:
                q = self.queues.get(delta.request_id)
                if q is not None:
                    delta.received = now   # latency metrics use this, not when it is read
                    q.put_nowait(delta)
        elif isinstance(msg, KVBlocks):
            self.kv_blocks = msg
        elif isinstance(msg, EngineDead):
            self._fail_all(msg.reason)

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
        if self.dead_reason is None:
            logger.error("%s: %s", self.log_prefix, reason)
        self.dead_reason = reason
        self._outbox.clear()
        message = f"{reason}; this request was not completed"
        for q in self.queues.values():
            q.fail(message)

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

    # -- requests -------------------------------------------------------------------------
    async def generate(self, request: EngineRequest, prompt: PromptTokens,
                       resumed: PromptTokens | None = None) -> AsyncIterator[CompletionDelta]:
        """Yields the request's deltas until all n sequences finished; stream=False yields
        them in bursts, when a sequence finishes. Leaving early (the client went away, the
        task was cancelled) aborts the request in the engine. prompt and resumed (output
        another worker streamed: request.num_resumed tokens) ride as int32 bytes after it."""
        self.check_available()
        request_id = request.request_id
        q = self.queues[request_id] = DeltaQueue(eager=request.stream)
        frame = b"" if prompt.is_placeholder else memoryview(prompt.array).cast("B")
        if resumed is not None:
            frame = bytes(frame) + memoryview(resumed.array).cast("B")
        open_seqs = request.params.n
        try:
            self._submit(request, frame)
            while open_seqs:
                try:
                    delta = await q.get()
                except EngineDeadError:
                    open_seqs = 0   # the engine that had it is gone: nothing to abort
                    raise
                if delta.finish_reason is not None:
                    open_seqs = 0 if delta.index < 0 or delta.error_param is not None else open_seqs - 1
                yield delta
        finally:
            self.queues.pop(request_id, None)
            if open_seqs and self.healthy:
                await self.abort([request_id])

    def _submit(self, msg: EngineRequest, frame: memoryview | bytes) -> None:
        self._outbox.append((msg, frame))
        if len(self._outbox) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        if batch and self.healthy:
            header = self._encoder.encode(AddRequests([msg for msg, _ in batch]))
            self.engine.send(pack_input(header, [frame for _, frame in batch]))

    async def abort(self, request_ids: list[str]) -> None:
        self._flush()   # an abort must not overtake the request it aborts
        if self.healthy:
            self.engine.send(pack_input(self._encoder.encode(AbortRequests(request_ids))))

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
