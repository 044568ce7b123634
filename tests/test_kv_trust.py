"""Nothing forged gets through the KV channel: each forgery sent by a real ZeroMQ socket on
loopback to a live CTX engine's KV server, which must refuse it and still serve the lease to
the GEN that holds the real handle.

Forged here: a pull with the right lease id and a wrong token, an ack with a wrong token, a
pull whose num_tokens is one off the lease's.
"""

import msgspec
import pytest
import zmq

from splitserve.kv.messages import PullAck, PullRequest, TcpPullReply

from disagg_utils import PROMPT, engine, handoff, wait_for_release
from kv_fault_utils import assert_healthy, close_engines, greedy_reference, pull_with

NUM_BLOCKS = 6   # PROMPT's 23 tokens in blocks of 4


@pytest.fixture(scope="module")
def pair(tiny_source):
    engines = engine(tiny_source), engine(tiny_source)
    yield engines
    close_engines(*engines)


@pytest.fixture(scope="module")
def want(pair):
    return greedy_reference(pair[0])


@pytest.fixture
def dealer():
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    yield sock
    zctx.destroy(linger=0)


def ask(sock, **fields):
    """Sends one forged PullRequest (fields override a valid one) and returns the reply."""
    sock.send(msgspec.msgpack.encode(PullRequest(**{
        "layout": "", "num_blocks": NUM_BLOCKS, "num_tokens": len(PROMPT), **fields})))
    assert sock.poll(15_000), "the KV server did not answer"
    return sock.recv_multipart()


def test_a_wrong_token_is_answered_like_an_unknown_lease(pair, want, dealer):
    ctx, gen = pair
    delta = handoff(ctx, "tok")
    h = delta.kv_handle
    assert len(h.lease_token) >= 16
    forged = dict(ctx_request_id=h.ctx_request_id, layout=h.layout,
                  lease_token=h.lease_token[:-1] + ("A" if h.lease_token[-1] != "A" else "B"))
    dealer.connect(h.endpoint)
    refused = ask(dealer, **forged)
    assert len(refused) == 1   # no block frames
    reply = msgspec.msgpack.decode(refused[0], type=TcpPullReply)
    assert "unknown or expired" in reply.error and reply.num_blocks == 0
    assert pull_with(gen, "tok", delta) == want   # the lease still pulls with its token
    wait_for_release(ctx)
    assert ctx.remote_kv.num_leased_blocks == 0
    # Now the lease is gone: the same forged request gets byte for byte the same answer.
    assert ask(dealer, **forged) == refused
    assert_healthy(ctx, gen)


def test_a_forged_ack_frees_nothing(pair, want, dealer):
    ctx, gen = pair
    delta = handoff(ctx, "ack")
    h = delta.kv_handle
    leased = ctx.remote_kv.num_leased_blocks
    assert leased == NUM_BLOCKS
    dealer.connect(h.endpoint)
    for token in ("", "x" * 22, h.lease_token.upper(), h.lease_token + "x"):
        if token != h.lease_token:
            dealer.send(msgspec.msgpack.encode(PullAck(h.ctx_request_id, token)))
    # The server answers in order: once this pull is refused, the acks before it were read.
    reply = ask(dealer, ctx_request_id="nope", lease_token="", layout=h.layout)
    assert "unknown or expired" in msgspec.msgpack.decode(reply[0], type=TcpPullReply).error
    for _ in range(20):
        ctx.step()
    assert ctx.remote_kv.num_leased_blocks == leased
    assert pull_with(gen, "ack", delta) == want
    wait_for_release(ctx)
    assert_healthy(ctx, gen)


@pytest.mark.parametrize("off", [-1, 1])
def test_num_tokens_one_off_the_lease_is_refused(pair, want, dealer, off):
    """22 and 24 tokens need the same 6 blocks as the lease's 23: only num_tokens differs."""
    ctx, gen = pair
    delta = handoff(ctx, f"len{off}")
    h = delta.kv_handle
    dealer.connect(h.endpoint)
    (frame,) = ask(dealer, ctx_request_id=h.ctx_request_id, layout=h.layout,
                   lease_token=h.lease_token, num_tokens=len(PROMPT) + off)
    reply = msgspec.msgpack.decode(frame, type=TcpPullReply)
    assert f"prompt_len {len(PROMPT) + off} disagrees" in reply.error and reply.num_blocks == 0
    assert pull_with(gen, f"len{off}", delta) == want
    wait_for_release(ctx)
    assert_healthy(ctx, gen)
