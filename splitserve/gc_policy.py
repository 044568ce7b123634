"""The garbage collector's schedule in the serving event loops (worker front-ends and the
orchestrator).

A full collection walks every tracked object while the event loop waits. With 1024 requests
held by a GEN front-end (~70 tracked objects each: coroutines, futures, the HTTP
server's per-connection state) one took 50-120 ms and came every ~15 s, the tail of
gen_preprocessing. The serving path makes no reference cycles (under held load every
collection, young or full, freed nothing), so full passes leave the automatic schedule for a
timer, and what lived at start-up is frozen out of every pass. The middle generation is
collected after every other young pass instead of every tenth: objects held across awaits
move on to the old generation sooner, and each middle pass walks ~1.4k objects, not ~7k
(its stalls went from up to 11 ms to up to 5 ms).
"""

from __future__ import annotations

import asyncio
import gc

FULL_GC_INTERVAL = 60.0     # seconds between full collections
_NEVER = 1 << 30            # young collections before an automatic full one


class ServingGC:
    """start() once the server's long-lived state exists; stop() restores the defaults."""

    def __init__(self, interval: float = FULL_GC_INTERVAL):
        self.interval = interval
        self._saved: tuple[int, int, int] | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        gc.collect()
        gc.freeze()
        self._saved = gc.get_threshold()
        gc.set_threshold(self._saved[0], 1, _NEVER)   # see the module docstring
        self._task = asyncio.get_running_loop().create_task(self._full_passes())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None
        gc.unfreeze()

    async def _full_passes(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            gc.collect()
