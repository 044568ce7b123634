"""The serving event loops' garbage-collector schedule (gc_policy.py)."""

import asyncio
import gc
import weakref

from splitserve.gc_policy import ServingGC


class _Node:
    pass


def test_full_passes_leave_the_automatic_schedule_for_a_timer_and_stop_restores_it():
    before = gc.get_threshold()

    async def main():
        policy = ServingGC(interval=0.2)
        policy.start()
        started = gc.get_threshold(), gc.get_freeze_count()
        # A reference cycle that reaches the old generation, then becomes garbage there.
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        gc.collect(1)
        gc.collect(1)
        del a, b
        for _ in range(3):
            gc.collect(1)                  # young passes never reach it
        young_only = gone() is not None
        await asyncio.sleep(0.5)           # the timer's full pass does
        policy.stop()
        return started, young_only, gone() is None

    (threshold, frozen), young_only, collected = asyncio.run(main())
    assert threshold[0] == before[0] and threshold[1] == 1 and threshold[2] >= 1 << 30
    assert frozen > 0                      # what lived at start-up is out of every pass
    assert young_only and collected
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
