"""The front-end's per-request delta queue (server/engine_client.py)."""

import asyncio

from splitserve.protocol.engine import CompletionDelta
from splitserve.server.engine_client import DeltaQueue


def _delta(token: int, finished: bool = False) -> CompletionDelta:
    return CompletionDelta("r", 0, [token], str(token), finish_reason=1 if finished else None)


async def _woken_after(q: DeltaQueue, deltas: list[CompletionDelta]) -> list[bool]:
    """Whether a waiting get() has returned after each put."""
    waiter, done = asyncio.ensure_future(q.get()), []
    await asyncio.sleep(0)
    for d in deltas:
        q.put_nowait(d)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        done.append(waiter.done())
    waiter.cancel()
    return done


def test_a_streaming_request_is_woken_by_every_delta():
    assert asyncio.run(_woken_after(DeltaQueue(eager=True), [_delta(1)])) == [True]


def test_a_whole_response_is_woken_once_a_sequence_finishes_and_keeps_order():
    async def main():
        q = DeltaQueue(eager=False)
        woken = await _woken_after(q, [_delta(1), _delta(2), _delta(3, finished=True)])
        rest = [(await q.get()).token_ids[0] for _ in range(2)]
        return woken, rest
    woken, rest = asyncio.run(main())
    assert woken == [False, False, True]
    assert rest == [2, 3]      # the woken get() took delta 1; nothing was lost or reordered
