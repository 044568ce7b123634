"""Faults inside the engine end the request they concern, with an error, and nothing else.

Each test injects one fault into a real part (the scheduler, the block manager, the
sampler, the detokenizer, the process's ZeroMQ threads) for one request and checks that
request ends with finish_reason error while the others finish exactly as without the fault,
and that the engine serves afterwards."""

import queue
import threading
import time

import msgspec
import numpy as np
import pytest
import zmq

from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.engine import process
from splitserve.engine.core import EngineCore
from splitserve.engine.request import FinishReason
from splitserve.errors import InvalidRequestError
from splitserve.protocol.engine import (
    AbortRequests, EngineRequest, AddRequests, CompletionDelta, EngineOutput, EngineOutputs,
    EngineStats, pack_input)
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens

from engine_requests import add_request

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def engine(tiny_source):
    cfg = EngineConfig(model="tiny-random", dtype="float32", seed=0,
                       cache=CacheConfig(4, 128, enable_prefix_caching=True),
                       scheduler=SchedulerConfig(64, 16))
    engine = EngineCore(cfg, tiny_source)
    yield engine
    bm = engine.block_manager   # a failed request must leave no block behind
    assert not engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def prompt(seed: int, n: int = 9) -> PromptTokens:
    return PromptTokens(np.random.default_rng(seed).integers(3, 49152, n).astype(np.int32))


def drain(engine, limit: int = 200) -> dict[tuple[str, int], list[CompletionDelta]]:
    """Step until idle; the deltas of each (request id, index)."""
    got: dict[tuple[str, int], list[CompletionDelta]] = {}
    for _ in range(limit):
        for d in engine.step():
            got.setdefault((d.request_id, d.index), []).append(d)
        if not engine.has_unfinished_requests():
            return got
    raise AssertionError("the engine did not finish its requests")


def tokens(deltas: list[CompletionDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def clean_run(engine, params=GREEDY) -> list[int]:
    add_request(engine, "ref", prompt(1), params)
    return tokens(drain(engine)[("ref", 0)])


def inject(monkeypatch, obj, name: str, is_bad) -> None:
    """obj.name raises for calls whose arguments is_bad() picks; others run as before."""
    real = getattr(obj, name)

    def faulty(*args, **kwargs):
        if is_bad(*args):
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)
    monkeypatch.setattr(obj, name, faulty)


def bad_request(req, *_):
    return getattr(req, "group_id", None) == "bad"


def assert_only_bad_failed(got, want_tokens, what: str):
    bad = [d for key, ds in got.items() if key[0] == "bad" for d in ds]
    assert bad[-1].finish_reason == FinishReason.ERROR
    assert what in bad[-1].error and "injected" not in bad[-1].error
    good = got[("good", 0)]
    assert good[-1].finish_reason == FinishReason.LENGTH and tokens(good) == want_tokens


@pytest.mark.parametrize("where, name, what", [
    ("scheduler", "add", "admitting"),
    ("block_manager", "allocate", "scheduling"),
    ("block_manager", "find_cached_prefix", "scheduling"),
    ("block_manager", "cache_full_blocks", "caching its KV blocks"),
    ("output", "detokenizer", "detokenizing"),
])
def test_a_fault_handling_one_request_ends_only_that_request(engine, monkeypatch, where, name,
                                                             what):
    want = clean_run(engine)
    inject(monkeypatch, engine if where == "engine" else getattr(engine, where), name,
           bad_request)
    add_request(engine, "bad", prompt(2), GREEDY)
    add_request(engine, "good", prompt(1), GREEDY)
    assert_only_bad_failed(drain(engine), want, what)
    monkeypatch.undo()
    assert clean_run(engine) == want


def test_a_sampling_fault_is_isolated_by_sampling_each_request_alone(engine, monkeypatch):
    want = clean_run(engine)
    calls = []
    inject(monkeypatch, engine, "sampler",
           lambda logits, reqs: calls.append(len(reqs)) or any(r.group_id == "bad" for r in reqs))
    add_request(engine, "bad", prompt(2), GREEDY)
    add_request(engine, "good", prompt(1), GREEDY)
    assert_only_bad_failed(drain(engine), want, "sampling")
    assert calls[:3] == [2, 1, 1]   # the batch, then each alone


def test_a_failing_sibling_fork_ends_that_sibling_only(engine, monkeypatch):
    inject(monkeypatch, engine.scheduler, "fork", lambda leader, sib, *_: sib.index == 1)
    add_request(engine, "bad", prompt(2), SamplingParams(n=3, temperature=0, max_tokens=4))
    got = drain(engine)
    assert got[("bad", 1)][-1].finish_reason == FinishReason.ERROR
    assert "forking" in got[("bad", 1)][-1].error
    assert tokens(got[("bad", 0)]) == tokens(got[("bad", 2)]) and len(tokens(got[("bad", 0)])) == 4


def test_a_request_that_cannot_even_be_ended_is_dropped(engine, monkeypatch):
    """Its detokenizer fails both stepping and flushing: the error path's own bookkeeping
    raises, and the request is still ended and its blocks freed."""
    class Broken:
        def step(self, ids):
            raise RuntimeError("injected fault")
        flush = step
    real = engine.output.detokenizer
    monkeypatch.setattr(engine.output, "detokenizer",
                        lambda req: Broken() if req.group_id == "bad" else real(req))
    monkeypatch.setattr(engine.output, "final_only", engine.output.final_only)
    want = clean_run(engine)
    add_request(engine, "bad", prompt(2), GREEDY, stream=False)
    add_request(engine, "good", prompt(1), GREEDY)
    assert_only_bad_failed(drain(engine), want, "detokenizing")


def test_a_request_whose_blocks_fail_to_free_still_ends_for_its_client(engine, monkeypatch):
    """The request has ended (its last token sampled) when freeing its blocks raises: its
    client gets its final delta, once, and the engine goes on."""
    kept, real = [], engine.block_manager.free

    def free(req):
        if req.group_id == "bad" and req.is_finished:
            kept.append(req)
            raise RuntimeError("injected fault")
        real(req)
    want = clean_run(engine)
    monkeypatch.setattr(engine.block_manager, "free", free)
    add_request(engine, "bad", prompt(2), GREEDY)
    add_request(engine, "good", prompt(1), GREEDY)
    got = drain(engine)
    monkeypatch.undo()
    for req in kept:   # what the fault left held
        real(req)
    ends = [d.finish_reason for d in got[("bad", 0)] if d.finish_reason is not None]
    assert ends == [FinishReason.LENGTH] and len(tokens(got[("bad", 0)])) == 6
    assert tokens(got[("good", 0)]) == want


def test_no_exception_escapes_step(engine, monkeypatch):
    """A fault no one request can be blamed for ends the requests in flight; the next
    request is served as usual."""
    want = clean_run(engine)
    add_request(engine, "a", prompt(2), GREEDY)
    add_request(engine, "b", prompt(3), GREEDY)
    engine.step()
    inject(monkeypatch, engine.remote_kv, "release_ended_leases", lambda: True)
    deltas = engine.step()
    assert {(d.request_id, d.finish_reason) for d in deltas} == {("a", FinishReason.ERROR),
                                                                  ("b", FinishReason.ERROR)}
    monkeypatch.undo()
    assert clean_run(engine) == want


def test_seeds_at_the_ends_of_int64_serve_n_siblings(engine):
    for seed in (2**63 - 1, -2**63):
        add_request(engine, "s", prompt(2), SamplingParams(n=3, seed=seed, max_tokens=3))
        got = drain(engine)
        assert all(got[("s", i)][-1].finish_reason == FinishReason.LENGTH for i in range(3))
    for seed in (2**63, 2**64 - 1, -2**63 - 1):
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(seed=seed)
        assert err.value.param == "seed"


def test_the_input_handler_answers_a_request_it_cannot_admit(engine):
    """Whatever add_request raises for one request (here: params that are no
    SamplingParams) becomes that request's error; the step loop goes on."""
    deltas: list[CompletionDelta] = []
    bad = EngineRequest(request_id="bad", params=None, prompt_len=9)
    bad.take_tokens(memoryview(prompt(2).array).cast("B"), time.time())
    good = EngineRequest.build("good", prompt(1), GREEDY)
    good.take_tokens(good.token_bytes(), time.time())
    process._handle(engine, bad, deltas)
    process._handle(engine, good, deltas)
    assert [(d.request_id, d.index, d.finish_reason) for d in deltas] == [
        ("bad", -1, FinishReason.ERROR)]
    assert "could not admit" in deltas[0].error
    assert tokens(drain(engine)[("good", 0)]) == clean_run(engine)


# -- the engine process's I/O threads --------------------------------------------------------
@pytest.fixture
def zmq_pair(tmp_path):
    """A context and an address; the test's sockets are closed here, then term() ends the
    I/O thread under test (its recv raises ContextTerminated) once it closed its socket."""
    ctx = zmq.Context()
    sockets = []

    def socket(kind):
        sockets.append(ctx.socket(kind))
        sockets[-1].setsockopt(zmq.LINGER, 0)
        return sockets[-1]
    yield socket, ctx, f"ipc://{tmp_path}/engine-io"
    for s in sockets:
        s.close()
    ctx.term()


def test_an_output_that_fails_to_encode_ends_only_its_request(zmq_pair):
    socket, ctx, addr = zmq_pair
    pull = socket(zmq.PULL)
    pull.bind(addr)
    pull.setsockopt(zmq.RCVTIMEO, 30_000)
    out_q, in_q = queue.Queue(), queue.Queue()
    sender = threading.Thread(target=process._send_loop, args=(ctx, addr, out_q, in_q), daemon=True)
    sender.start()
    stats = EngineStats(0, 0, 0, 1, 0, 0)
    good = CompletionDelta("good", 0, [5], "fine")
    bad = CompletionDelta("bad", 1, [7], "\ud800")   # a lone surrogate: msgpack refuses it
    decoder = msgspec.msgpack.Decoder(EngineOutput)
    out_q.put(EngineOutputs([good, bad], stats))
    got = decoder.decode(pull.recv()).deltas
    assert got[0] == good
    assert (got[1].request_id, got[1].index, got[1].finish_reason) == ("bad", 1, FinishReason.ERROR)
    assert "could not send" in got[1].error
    assert in_q.get(timeout=5) == AbortRequests(["bad"])   # its work stops in the engine
    out_q.put(EngineOutputs([good], stats))                # the thread still sends
    assert decoder.decode(pull.recv()).deltas == [good]
    out_q.put(None)
    sender.join(10)


def test_an_input_that_fails_to_decode_answers_each_request_it_names(zmq_pair, engine):
    socket, ctx, addr = zmq_pair
    push = socket(zmq.PUSH)
    push.bind(addr)
    in_q = queue.Queue()
    threading.Thread(target=process._recv_loop, args=(ctx, addr, in_q), daemon=True).start()
    good = EngineRequest.build("good", prompt(1), GREEDY)
    garbled = {"request_id": "bad", "params": {"temperature": "hot"}, "prompt_len": 2}
    refused = {"request_id": "refused", "params": {"seed": 2**64 - 1}, "prompt_len": 1}
    header = msgspec.msgpack.encode({"type": "add", "requests": [
        msgspec.to_builtins(good, builtin_types=(bytes,)), garbled, {"no": "id"}, refused]})
    push.send(b"\x01\x00")                                  # not even a header
    push.send(pack_input(header, [prompt(1).array.tobytes(), b"\0" * 8, b"\0" * 4]))
    items = [in_q.get(timeout=30) for _ in range(3)]
    deltas: list[CompletionDelta] = []
    for item in items:
        process._handle(engine, item, deltas)
    assert [(d.request_id, d.finish_reason, d.error_param) for d in deltas] == [
        ("bad", FinishReason.ERROR, None), ("refused", FinishReason.ERROR, "seed")]
    assert deltas[0].index == -1 and "could not read" in deltas[0].error
    got = drain(engine)   # the request that decoded alone is served
    assert got[("good", 0)][-1].finish_reason == FinishReason.LENGTH
    assert tokens(got[("good", 0)]) == clean_run(engine)
    push.send(pack_input(msgspec.msgpack.encode(AddRequests([EngineRequest.build(
        "next", prompt(1), GREEDY)])), [prompt(1).array.tobytes()]))
    assert in_q.get(timeout=30).request_id == "next"   # the thread still reads
