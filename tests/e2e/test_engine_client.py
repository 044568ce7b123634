"""The front-end's per-request delta queue and its messages to the engine process
(server/engine_client.py, protocol/engine.py)."""

import asyncio

import pytest

from splitserve.protocol.engine import CompletionDelta, EngineRequest
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


def test_one_frame_carries_a_batch_and_a_bad_batch_fails_its_requests_not_the_engine():
    """A real engine process: prompts submitted in one event-loop turn travel in one frame
    and each request gets its own prompt back; a frame whose prompt bytes do not match the
    declared lengths answers each of its requests with an error, and the engine goes on."""
    import numpy as np

    from splitserve.config import EngineConfig
    from splitserve.protocol.engine import AddRequests, pack_input
    from splitserve.sampling_params import SamplingParams
    from splitserve.server.engine_client import EngineClient
    from splitserve.tokens import PromptTokens

    params = SamplingParams(max_tokens=1, temperature=0.0)

    async def collect(client, rid, prompt):
        request = EngineRequest.build(rid, prompt, params, stream=False)
        return [d async for d in client.generate(request)]

    async def main():
        client = EngineClient(EngineConfig(model="tiny-random", dtype="float32", num_threads=1))
        await client.start()
        try:
            lengths = (3, 17, 5)
            batch = await asyncio.gather(*(collect(client, f"ok-{n}", PromptTokens(
                np.arange(1, n + 1, dtype=np.int32))) for n in lengths))
            # Two requests declaring 4 and 2 tokens with the bytes of 5: the batch is wrong.
            q1, q2 = DeltaQueue(eager=False), DeltaQueue(eager=False)
            client.queues.update({"bad-1": q1, "bad-2": q2})
            reqs = [EngineRequest(request_id=rid, params=params, prompt_len=n)
                    for rid, n in (("bad-1", 4), ("bad-2", 2))]
            client.engine.in_sock.send(pack_input(client._encoder.encode(AddRequests(reqs)),
                                           [np.arange(5, dtype=np.int32).tobytes()]))
            bad = [await asyncio.wait_for(q.get(), 60) for q in (q1, q2)]
            after = await collect(client, "after", PromptTokens(np.arange(1, 4, dtype=np.int32)))
        finally:
            await client.shutdown()
        return batch, bad, after

    batch, bad, after = asyncio.run(main())
    assert [d[-1].num_prompt_tokens for d in batch] == [3, 17, 5]
    assert all(d[-1].error is None and len(d[-1].token_ids) == 1 for d in batch)
    assert [d.request_id for d in bad] == ["bad-1", "bad-2"]
    assert all("do not match its prompt lengths" in d.error for d in bad)
    assert after[-1].error is None and after[-1].num_prompt_tokens == 3


def test_pack_input_splits_back_into_each_requests_prompt():
    import numpy as np

    from splitserve.protocol.engine import pack_input, split_prompts, unpack_input
    from splitserve.sampling_params import SamplingParams

    p = SamplingParams()
    reqs = [EngineRequest(request_id="a", params=p, prompt_len=3),
            EngineRequest(request_id="b", params=p, prompt_len=1000, placeholder=True),
            EngineRequest(request_id="c", params=p, prompt_len=2)]
    a, c = np.array([1, 2, 3], "<i4"), np.array([7, -1], "<i4")
    frame = pack_input(b"HEADER", [a.data.cast("B"), b"", c.tobytes()])
    header, body = unpack_input(memoryview(frame))
    assert bytes(header) == b"HEADER"
    got = split_prompts(reqs, body)
    assert [np.frombuffer(g, "<i4").tolist() for g in got] == [[1, 2, 3], [], [7, -1]]
    assert split_prompts(reqs, body[:-4]) == [None] * 3            # bytes missing
    assert split_prompts(reqs[:1], body) == [None]                 # bytes left over
    negative = EngineRequest(request_id="n", params=p, prompt_len=-2)
    assert split_prompts([negative], body[:0]) == [None]


def _client(**kwargs):
    from splitserve.config import EngineConfig
    from splitserve.server.engine_client import EngineClient
    return EngineClient(EngineConfig(model="tiny-random", dtype="float32", num_threads=1),
                        **kwargs)


async def _until(what, timeout: float = 120.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not what():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.05)


def test_a_killed_engine_fails_what_it_held_and_restarts_backing_off(caplog):
    """kill -9 of the engine process: a streaming and a final-only request in flight each
    raise EngineDeadError naming the signal, the client refuses new requests while a new
    process starts, then serves. A second death soon after, whose replacement fails to
    start (its model is gone), restarts after 1 s, then 2 s, until one starts."""
    import dataclasses
    import logging
    import os
    import signal

    import numpy as np

    from splitserve.sampling_params import SamplingParams
    from splitserve.server.engine_client import EngineDeadError
    from splitserve.tokens import PromptTokens

    prompt = PromptTokens(np.arange(1, 5, dtype=np.int32))
    long = SamplingParams(max_tokens=50_000, ignore_eos=True)

    async def run(client, rid, params, stream):
        got = []
        try:
            request = EngineRequest.build(rid, prompt, params, stream=stream)
            async for d in client.generate(request):
                got.append(d)
        except EngineDeadError as exc:
            return got, str(exc)
        return got, None

    async def main():
        client = _client()
        await client.start()
        try:
            streaming = asyncio.create_task(run(client, "s", long, True))
            whole = asyncio.create_task(run(client, "w", long, False))
            await _until(lambda: client.stats.num_running == 2)
            os.kill(client.process.pid, signal.SIGKILL)
            results = await asyncio.gather(streaming, whole)
            refused = client.health()
            with pytest.raises(EngineDeadError, match="restarting"):
                [d async for d in client.generate(EngineRequest.build("early", prompt, long))]
            await _until(lambda: client.health() is None)
            after = await run(client, "after", SamplingParams(max_tokens=2), False)
            good = client.config
            client.config = dataclasses.replace(good, model="/no/such/model")
            os.kill(client.process.pid, signal.SIGKILL)       # dies again at once: backs off
            await _until(lambda: "failed to start" in (client.health() or ""))
            client.config = good
            await _until(lambda: client.health() is None)
            again = await run(client, "again", SamplingParams(max_tokens=2), False)
            return results, refused, after, again, client.restarts
        finally:
            await client.shutdown()

    with caplog.at_level(logging.WARNING, logger="splitserve.server.engine_client"):
        results, refused, after, again, restarts = asyncio.run(main())
    for got, error in results:
        assert error is not None and "stopped unexpectedly (signal 9" in error
        assert "this request was not completed" in error
    assert len(results[0][0]) > 0          # it had streamed before it failed
    assert "restarting" in refused and "signal 9" in refused
    assert after[1] is None and len(after[0][-1].token_ids) == 2
    assert again[1] is None and restarts == 3
    lines = [r.getMessage() for r in caplog.records if "restarting it in" in r.getMessage()]
    assert [line[line.index("restarting it in"):].split(";")[0] for line in lines] == [
        "restarting it in 0 s (restart 1", "restarting it in 1 s (restart 2",
        "restarting it in 2 s (restart 3"]


def test_the_engine_reports_liveness_while_idle_and_its_kv_transport_health():
    """Its step count moves without any request (the front-end's stall check relies on it);
    a KV transport whose threads stopped shows in the stats, hence on /health."""
    from splitserve.config import EngineConfig
    from splitserve.engine.core import EngineCore
    from splitserve.engine.process import _stats

    async def main():
        client = _client()
        await client.start()
        try:
            first = client.stats.steps
            await _until(lambda: client.stats.steps >= first + 2, timeout=60)
            return client.health()
        finally:
            await client.shutdown()
    assert asyncio.run(main()) is None

    engine = EngineCore(EngineConfig(model="tiny-random", dtype="float32", num_threads=1))
    assert _stats(engine).kv_error == ""
    engine.remote_kv.close()
    assert "KV transport threads stopped" in _stats(engine).kv_error


def test_the_engine_sockets_live_in_a_directory_only_this_user_may_enter():
    """Another local user must not reach the engine's ipc sockets and feed it requests."""
    import os
    import stat

    import zmq.asyncio

    from splitserve.config import EngineConfig
    from splitserve.server.engine_process import EngineProcess

    async def life() -> str:
        ctx = zmq.asyncio.Context()
        try:
            proc = EngineProcess(ctx, EngineConfig(model="tiny-random"), "t")
            assert stat.S_IMODE(os.stat(proc.ipc_dir).st_mode) == 0o700
            assert proc.input_addr.startswith(f"ipc://{proc.ipc_dir}/")
            assert os.path.exists(proc.input_addr.removeprefix("ipc://"))
            proc.close()
            return proc.ipc_dir
        finally:
            ctx.destroy(linger=0)

    assert not os.path.exists(asyncio.run(life()))


def test_an_engine_whose_starter_died_while_it_loaded_exits(tmp_path):
    """The pid of the process that started the engine is given to it, not read once it has
    loaded: a front-end killed while its engine imports torch and builds the model (up's
    workers, when up itself fails) leaves no engine behind, waiting for a parent that is
    gone. Here the engine is told its starter is a process that has already exited."""
    import multiprocessing
    import subprocess
    import sys
    from splitserve.config import EngineConfig
    from splitserve.engine.process import run_engine_core
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    proc = multiprocessing.get_context("spawn").Process(target=run_engine_core, args=(
        EngineConfig(model="tiny-random", dtype="float32", num_threads=1),
        f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", "t", gone.pid))
    proc.start()
    proc.join(120)
    alive = proc.is_alive()
    if alive:
        proc.kill()
    assert not alive and proc.exitcode == 0
