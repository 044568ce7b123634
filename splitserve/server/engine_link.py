"""A front-end's side of its engine: submit, stream, abort, stats, health. Who owns the
engine process (starts and restarts it) is a subclass's business: EngineClient
(engine_client.py) owns it; with several front-ends per worker, PeerEngineClient
(peer_client.py) shares one owned by the serve process.

A callback on the output socket's file descriptor routes each CompletionDelta to the
queue of its request. Requests go out batched: everything submitted during one event-loop
turn leaves in one AddRequests message at the end of the turn, with the prompts as raw int32
bytes in the same frame, so a burst of arrivals costs one ZeroMQ send, not one each.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import msgspec

from splitserve.protocol.engine import (
    AbortRequests, AddRequests, CompletionDelta, Drain, EngineDead, EngineOutputs, EngineReady,
    EngineRequest, EngineStats, KVBlocks, pack_input)
from splitserve.server.delta_queue import DeltaQueue
from splitserve.server.engine_process import EngineDeadError, EngineSockets

logger = logging.getLogger(__name__)


class EngineLink:
    """`peer`: this front-end's number among the engine's (0: the one that owns it)."""

    def __init__(self, log_prefix: str = "engine", stall_seconds: float = 60.0, peer: int = 0):
        self.log_prefix = log_prefix
        self.stall_seconds = stall_seconds     # no step this long while holding work: stuck
        self.peer = peer
        self.queues: dict[str, DeltaQueue] = {}
        self.ready: EngineReady | None = None
        self.stats = EngineStats(0, 0, 0, 0, 0, 0)
        self.kv_blocks: KVBlocks | None = None   # the engine's last prefix cache report
        self.dead_reason: str | None = None    # set while the engine is down (restarting)
        self.engine: EngineSockets | None = None
        self.restarts = 0
        self.peer_reports: dict = {}   # the other front-ends' last FrontendReport, by number
        self._last_step = time.monotonic()
        self._encoder = msgspec.msgpack.Encoder()
        self._outbox: list[EngineRequest] = []

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
    def in_flight(self) -> int:
        """Requests submitted and not finished, by this front-end and (as of their last
        reports) the worker's other front-ends."""
        return len(self.queues) + self.peers_in_flight()

    def peers_in_flight(self) -> int:
        """The worker's other front-ends' requests in flight, as of their last reports."""
        return sum(r.in_flight for r in self.peer_reports.values()) if self.peer_reports else 0

    @property
    def num_waiting(self) -> int:
        """Requests in flight that the engine is not running (as of its last stats): what
        load shedding bounds."""
        return max(self.in_flight - self.stats.num_running, 0)

    def _serving(self, ready: EngineReady) -> None:
        """The engine is ready: requests are taken from now on."""
        self.ready, self.dead_reason = ready, None
        self.stats = EngineStats(0, 0, 0, ready.num_blocks, 0, 0)
        self.kv_blocks = None
        self._last_step = time.monotonic()

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

    def _fail_all(self, reason: str) -> None:
        if self.dead_reason is None:
            logger.error("%s: %s", self.log_prefix, reason)
        self.dead_reason = reason
        self._outbox.clear()
        message = f"{reason}; this request was not completed"
        for q in self.queues.values():
            q.fail(message)

    # -- requests -------------------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[CompletionDelta]:
        """Yields the request's deltas until all n sequences finished; stream=False yields
        them in bursts, when a sequence finishes. Leaving early (the client went away, the
        task was cancelled) aborts the request in the engine. Its prompt and resumed output
        (another worker streamed it) ride as int32 bytes after it."""
        self.check_available()
        request_id = request.request_id
        q = self.queues[request_id] = DeltaQueue(eager=request.stream)
        open_seqs = request.params.n
        try:
            self._submit(request)
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

    def _submit(self, request: EngineRequest) -> None:
        self._outbox.append(request)
        if len(self._outbox) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        if batch and self.healthy:
            header = self._encoder.encode(AddRequests(batch, self.peer))
            self.engine.send(pack_input(header, [r.token_bytes() for r in batch]))

    def drain(self) -> None:
        """This front-end is stopping: the engine hands off its movable streams (Drain)."""
        self._flush()
        if self.healthy:
            self.engine.send(pack_input(self._encoder.encode(Drain(self.peer))))

    async def abort(self, request_ids: list[str]) -> None:
        self._flush()   # an abort must not overtake the request it aborts
        if self.healthy:
            self.engine.send(pack_input(self._encoder.encode(AbortRequests(request_ids))))
