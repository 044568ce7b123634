"""One request's queue of engine deltas in the front-end."""

from __future__ import annotations

import asyncio
import collections

from splitserve.protocol.engine import CompletionDelta
from splitserve.server.engine_process import EngineDeadError


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
