"""The KV transport survives its peers: each fault injected with real sockets on loopback.

A pull to an endpoint nobody listens on fails at once; a CTX that stops answering fails only
the pulls waiting on it while pulls from another CTX complete; a wrong reply fails its pull
and writes nothing; garbage on a CTX's KV port is dropped and the server keeps answering;
the GEN closes its sockets to failed and idle CTXs. Over both backends where the fault
applies (nixl's tests skip when it is not importable); misbehaving CTXs are real ZeroMQ
ROUTER sockets, stopped and killed CTXs real processes (tests/support/kv_ctx_process.py).
"""

import signal
import socket
import time

import msgspec
import numpy as np
import pytest
import torch
import zmq

from splitserve.engine.request import FinishReason
from splitserve.errors import InvalidRequestError
from splitserve.kv.checksums import block_sums
from splitserve.kv.messages import NixlPullReply, PullRequest, TcpPullReply
from splitserve.protocol.engine import KVHandle, RemotePrefill

from disagg_utils import (BACKENDS, GREEDY, PROMPT, digest, drain, engine, handoff,
                          require_backend, tokens, wait_for_release)
from kv_fault_utils import (CtxProcess, FakeCtx, assert_healthy, closed_port, connections_to,
                            ended_in_error, oversized_message_is_refused, outcome, port_of,
                            wait_for)
from engine_requests import add_request

NUM_BLOCKS = 6   # PROMPT's 23 tokens in blocks of 4


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    require_backend(request.param)
    return request.param


@pytest.fixture(scope="module")
def pairs(tiny_source):
    """pairs(backend) -> (ctx, gen) in-process engines, made once per backend. The GEN
    keeps no prefix cache: the fake CTXs offer every block of PROMPT, pull after pull."""
    made = {}

    def get(backend):
        require_backend(backend)
        if backend not in made:
            made[backend] = (engine(tiny_source, backend),
                             engine(tiny_source, backend, prefix_caching=False))
        return made[backend]
    yield get
    for pair in made.values():
        for e in pair:
            e.remote_kv.close()


@pytest.fixture(scope="module")
def want(pairs):
    ctx, _ = pairs("tcp")
    add_request(ctx, "ref", PROMPT, GREEDY)
    return tokens(drain(ctx))


@pytest.fixture
def fakes():
    made = []

    def make(answer, repeat=1):
        made.append(FakeCtx(answer, repeat))
        return made[-1]
    yield make
    for fake in made:
        fake.close()


def forged(gen, endpoint, rid):
    return KVHandle(backend=gen.remote_kv.config.backend, endpoint=endpoint, ctx_request_id=rid,
                    layout=gen.remote_kv.layout, num_tokens=len(PROMPT),
                    prompt_digest=digest())


def pull(gen, rid, handle, first_tokens, logprobs=None):
    add_request(gen, rid, PROMPT, GREEDY, remote=RemotePrefill(handle, first_tokens, logprobs))


def pull_handoff(gen, rid, delta):
    pull(gen, rid, delta.kv_handle, delta.token_ids, delta.logprobs)


# -- unreachable and stuck CTXs ---------------------------------------------------------------

def test_a_pull_to_an_unconnectable_endpoint_fails_at_once(tiny_source, pairs, backend, want):
    """Timeouts of 120 s: only the refused connection can end the dead pull within drain's
    30 s, and the pull from a live CTX completes beside it."""
    ctx, _ = pairs(backend)
    gen = engine(tiny_source, backend, timeout=120.0, connect_timeout=120.0)
    try:
        dead = forged(gen, f"tcp://127.0.0.1:{closed_port()}", "d")
        pull(gen, "dead", dead, want[:1])
        pull_handoff(gen, "alive", handoff(ctx, "alive"))
        final, _ = outcome(drain(gen, timeout=30))
        assert ended_in_error(final["dead"], "could not connect")
        assert final["alive"].finish_reason == FinishReason.LENGTH
        assert dead.endpoint not in gen.remote_kv.transport.pool.idle   # its socket is closed
        wait_for_release(ctx)
        assert_healthy(gen, ctx)
    finally:
        gen.remote_kv.close()


def test_a_handle_whose_endpoint_is_not_tcp_is_refused(pairs, backend):
    _, gen = pairs(backend)
    for endpoint in ("ipc:///tmp/engine-input", "tcp://127.0.0.1", "inproc://x"):
        with pytest.raises(InvalidRequestError) as err:
            pull(gen, "bad", forged(gen, endpoint, "x"), [5])
        assert err.value.param == "disaggregated_params.kv_handle"


def test_a_ctx_that_stops_answering_fails_only_the_pulls_waiting_on_it(pairs, backend, fakes,
                                                                       want):
    ctx, gen = pairs(backend)
    stuck = fakes(lambda request: None)
    for i in range(3):
        pull(gen, f"stuck{i}", forged(gen, stuck.endpoint, f"s{i}"), want[:1])
    pull_handoff(gen, "live", handoff(ctx, "live"))
    out = drain(gen, timeout=60)
    final, first = outcome(out)
    assert tokens([d for d in out if d.request_id == "live"]) == want
    for i in range(3):
        assert ended_in_error(final[f"stuck{i}"], "did not answer within 5 s")
        assert first["live"] < out.index(final[f"stuck{i}"])   # not held up by the stuck CTX
    # The pulls queued behind the first failed with it instead of each waiting again.
    assert len(stuck.requests) == 1
    wait_for_release(ctx)
    assert_healthy(gen, ctx)


@pytest.fixture
def ctx_process(backend):
    procs = []

    def start():
        procs.append(CtxProcess(backend))
        return procs[-1]
    yield start
    for p in procs:
        p.stop()


def test_a_stopped_ctx_process_fails_its_pull_while_another_ctx_serves(pairs, backend,
                                                                       ctx_process, want):
    ctx, gen = pairs(backend)
    proc = ctx_process()
    h = proc.handoff("warm")   # a first pull connects the GEN before the CTX stops
    pull(gen, "warm", h.handle, h.tokens, h.logprobs)
    assert tokens(drain(gen, timeout=60)) == want
    h = proc.handoff("p1")
    proc.signal(signal.SIGSTOP)
    pull(gen, "stopped", h.handle, h.tokens, h.logprobs)
    pull_handoff(gen, "healthy", handoff(ctx, "healthy"))
    out = drain(gen, timeout=60)
    final, first = outcome(out)
    assert ended_in_error(final["stopped"], "did not answer within")
    assert tokens([d for d in out if d.request_id == "healthy"]) == want
    assert first["healthy"] < out.index(final["stopped"])
    proc.signal(signal.SIGCONT)   # back: the next pull reconnects afresh
    h = proc.handoff("p2")
    pull(gen, "resumed", h.handle, h.tokens, h.logprobs)
    assert tokens(drain(gen, timeout=60)) == want
    wait_for_release(ctx)
    assert_healthy(gen, ctx)


def test_a_ctx_process_killed_mid_pull_fails_the_pull_at_once(tiny_source, backend, ctx_process,
                                                             want):
    """The pull may take 120 s, but the lost connection ends it within drain's 30 s."""
    gen = engine(tiny_source, backend, timeout=120.0)
    try:
        proc = ctx_process()
        h = proc.handoff("warm")
        pull(gen, "warm", h.handle, h.tokens, h.logprobs)
        assert tokens(drain(gen, timeout=60)) == want
        h = proc.handoff("p")
        proc.signal(signal.SIGSTOP)
        pull(gen, "g", h.handle, h.tokens, h.logprobs)
        gen.step()
        assert wait_for(lambda: h.handle.endpoint in gen.remote_kv.transport.pool.busy)
        time.sleep(0.5)   # the request leaves for the stopped CTX
        proc.stop()
        (delta,) = drain(gen, timeout=30)
        assert ended_in_error(delta, "lost the connection", "could not connect")
        assert_healthy(gen)
    finally:
        gen.remote_kv.close()


# -- wrong replies ----------------------------------------------------------------------------

def tcp_reply(request, frames, **fields):
    """A reply offering these frames, with their true checksums unless fields say otherwise."""
    fields = {"ctx_request_id": request.ctx_request_id, "num_blocks": request.num_blocks,
              "block_sums": block_sums(frames), **fields}
    return [msgspec.msgpack.encode(TcpPullReply(**fields)), *frames]


def blocks(size, n=NUM_BLOCKS):
    return [b"\x7f" * size] * n


TCP_REPLIES = {   # name: (answer(request, block bytes, max frame), words of the error)
    "too few frames": (lambda r, b, m: tcp_reply(r, blocks(b, 5)), "6 KV blocks in 5 frames"),
    "too many frames": (lambda r, b, m: tcp_reply(r, blocks(b, 7)), "in 7 frames, expected 6"),
    "block count lies": (lambda r, b, m: tcp_reply(r, blocks(b), num_blocks=7),
                         "offered 7 KV blocks in 6 frames"),
    "short frame": (lambda r, b, m: tcp_reply(r, blocks(b, 5) + [b"\0" * (b - 1)]),
                    f"frame 5 holds {2048 - 1} bytes, expected 2048"),
    "long frame": (lambda r, b, m: tcp_reply(r, [b"\0" * (b + 1)] + blocks(b, 5)),
                   f"frame 0 holds {2048 + 1} bytes"),
    "frame over the socket's limit": (lambda r, b, m: tcp_reply(r, blocks(b, 5) + [b"\0" * (m + 1)]),
                                      "lost the connection"),
    "error reply with frames": (lambda r, b, m: tcp_reply(r, blocks(b, 1), error="no"),
                                "error reply came with 1 more frames"),
    "no checksums": (lambda r, b, m: tcp_reply(r, blocks(b), block_sums=b""),
                     "0 bytes of block checksums for 6 KV blocks"),
    "too few checksums": (lambda r, b, m: tcp_reply(r, blocks(b), block_sums=bytes(40)),
                          "40 bytes of block checksums"),
}


def nixl_reply(request, block_bytes, frames=(), **fields):
    fields = {"ctx_request_id": request.ctx_request_id, "agent_name": "fake",
              "agent_metadata": b"m", "base_addr": 1 << 20, "block_bytes": block_bytes,
              "block_ids": list(range(request.num_blocks)), **fields}
    return [msgspec.msgpack.encode(NixlPullReply(**fields)), *frames]


NIXL_REPLIES = {
    "wrong block size": (lambda r, b, m: nixl_reply(r, 2 * b), "6 KV blocks of 4096 bytes, "
                         "expected 6 of 2048"),
    "wrong block count": (lambda r, b, m: nixl_reply(r, b, block_ids=[1, 2]), "offered 2 KV blocks"),
    "negative block id": (lambda r, b, m: nixl_reply(r, b, block_ids=[-1, 1, 2, 3, 4, 5]),
                          "out of range"),
    "no agent": (lambda r, b, m: nixl_reply(r, b, agent_name=""), "names no agent"),
    "extra frames": (lambda r, b, m: nixl_reply(r, b, [b"x"]), "1 unexpected frames"),
    "frame over the socket's limit": (lambda r, b, m: [b"\0" * (m + 1)], "lost the connection"),
}

ANY_REPLIES = {
    "malformed reply": (lambda r, b, m: [b"\xc1 not msgpack"], "malformed reply"),
    "reply of the wrong shape": (lambda r, b, m: [msgspec.msgpack.encode({"ctx_request_id": 6})],
                                 "malformed reply"),
    "another request's reply": (lambda r, b, m: [msgspec.msgpack.encode(
        {"ctx_request_id": "other", "error": "x"})], "answered for 'other'"),
    "no answer": (lambda r, b, m: None, "did not answer within"),
}


def check_wrong_reply(ctx, gen, fake_for, answer, words, want):
    transport = gen.remote_kv.transport
    fake = fake_for(lambda r: answer(r, transport.block_nbytes, transport._max_frame()))
    before = gen.runner.kv_cache.clone()
    pull(gen, "wrong", forged(gen, fake.endpoint, "w"), want[:1])
    (delta,) = drain(gen, timeout=30)
    assert ended_in_error(delta, words), delta.error
    assert torch.equal(gen.runner.kv_cache, before)   # not a byte written, anywhere
    assert_healthy(gen)
    pull_handoff(gen, "after", handoff(ctx, "after"))   # the pull threads live on
    assert tokens(drain(gen)) == want
    wait_for_release(ctx)


@pytest.mark.parametrize("case", list(ANY_REPLIES))
def test_a_wrong_reply_fails_its_pull_and_writes_nothing(pairs, backend, fakes, want, case):
    check_wrong_reply(*pairs(backend), fakes, *ANY_REPLIES[case], want)


@pytest.mark.parametrize("case", list(TCP_REPLIES))
def test_a_wrong_tcp_offer_fails_its_pull_and_writes_nothing(pairs, fakes, want, case):
    check_wrong_reply(*pairs("tcp"), fakes, *TCP_REPLIES[case], want)


@pytest.mark.parametrize("case", list(NIXL_REPLIES))
def test_a_wrong_nixl_offer_fails_its_pull_and_writes_nothing(pairs, fakes, want, case):
    check_wrong_reply(*pairs("nixl"), fakes, *NIXL_REPLIES[case], want)


def test_a_ctx_that_answers_twice_cannot_pass_off_a_stale_answer(pairs, fakes, want, caplog):
    """The second answer to the first pull waits on the socket when the second pull starts:
    it is dropped, and the second pull takes only the answer naming its own lease."""
    _, gen = pairs("tcp")
    size = gen.remote_kv.transport.block_nbytes
    fake = fakes(lambda r: tcp_reply(r, blocks(size)), repeat=2)
    for i in (1, 2):
        pull(gen, f"twice{i}", forged(gen, fake.endpoint, f"t{i}"), want[:1])
        (last,) = [d for d in drain(gen) if d.finish_reason is not None]
        assert last.finish_reason == FinishReason.LENGTH, last.error
        assert wait_for(lambda: fake.sent == 2 * i)
    assert "dropped 1 unrequested messages" in caplog.text
    assert_healthy(gen)


def test_a_failing_done_callback_does_not_stop_the_pull_threads(pairs, want):
    ctx, gen = pairs("tcp")
    first = handoff(ctx, "cb")

    def done(result):
        raise RuntimeError("callback bug")
    gen.remote_kv.transport.pull(first.kv_handle, np.arange(100, 100 + NUM_BLOCKS), done)
    wait_for_release(ctx)   # the pull went through and acked
    assert ctx.remote_kv.num_leased_blocks == 0
    pull_handoff(gen, "after-cb", handoff(ctx, "after-cb"))
    assert tokens(drain(gen)) == want
    wait_for_release(ctx)
    assert_healthy(gen, ctx)


# -- garbage to the CTX -----------------------------------------------------------------------

def test_garbage_on_the_kv_port_is_dropped_and_the_server_keeps_answering(tiny_source, pairs,
                                                                          backend, want, caplog):
    _, gen = pairs(backend)
    ctx = engine(tiny_source, backend)
    zctx = zmq.Context()
    try:
        endpoint = ctx.remote_kv.endpoint
        for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 20, np.random.default_rng(1).bytes(100_000),
                     b"\xff" + bytes(8) + b"\x7f"):
            with socket.create_connection(("127.0.0.1", port_of(endpoint))) as raw:
                try:
                    raw.sendall(junk)
                except OSError:   # the server may drop us before we finish
                    pass
        request = msgspec.msgpack.encode(PullRequest("x", "t", gen.remote_kv.layout, NUM_BLOCKS,
                                                     len(PROMPT)))
        req = zctx.socket(zmq.REQ)   # its empty delimiter frame makes a 2-frame message
        req.connect(endpoint)
        req.send(request)
        dealer = zctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send_multipart([request, request])
        dealer.send(b"\xc1\xc1")
        dealer.send(msgspec.msgpack.encode({"type": "pull", "ctx_request_id": 5}))
        push = zctx.socket(zmq.PUSH)   # not a socket type a ROUTER talks to
        push.connect(endpoint)
        push.send(request, zmq.NOBLOCK)
        assert oversized_message_is_refused(zctx, endpoint)
        assert not req.poll(200) and not dealer.poll(200)   # no answer to any of it
        pull_handoff(gen, "after-garbage", handoff(ctx, "after-garbage"))
        assert tokens(drain(gen)) == want
        assert wait_for(lambda: "dropped a message of" in caplog.text and
                        "dropped an undecodable message" in caplog.text)
        wait_for_release(ctx)
        assert_healthy(ctx, gen)
    finally:
        zctx.destroy(linger=0)
        ctx.remote_kv.close()


# -- sockets to failed and idle CTXs ----------------------------------------------------------

def test_the_gen_closes_its_socket_to_a_ctx_that_failed(tiny_source, backend, fakes, want):
    gen = engine(tiny_source, backend, timeout=2.0)
    try:
        stuck = fakes(lambda request: None)
        pull(gen, "g", forged(gen, stuck.endpoint, "s"), want[:1])
        gen.step()
        assert wait_for(lambda: connections_to(stuck.port) == 1)
        (delta,) = drain(gen, timeout=30)
        assert ended_in_error(delta, "did not answer within")
        assert wait_for(lambda: connections_to(stuck.port) == 0)
        assert_healthy(gen)
    finally:
        gen.remote_kv.close()


def test_the_gen_closes_idle_sockets(tiny_source, backend, want):
    ctx = engine(tiny_source, backend)
    gen = engine(tiny_source, backend, idle_seconds=1.0)
    try:
        port = port_of(ctx.remote_kv.endpoint)
        pull_handoff(gen, "g", handoff(ctx, "c"))
        assert tokens(drain(gen)) == want
        assert connections_to(port) == 1
        assert wait_for(lambda: connections_to(port) == 0)
        wait_for_release(ctx)
        assert_healthy(ctx, gen)
    finally:
        ctx.remote_kv.close()
        gen.remote_kv.close()
