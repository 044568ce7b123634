"""Nothing forged gets through the KV channel: each forgery sent by a real ZeroMQ socket on
loopback to a live CTX engine's KV server, which must refuse it and still serve the lease to
the GEN that holds the real handle.

Forged here: a pull with the right lease id and a wrong token, an ack with a wrong token, a
pull whose num_tokens is one off the lease's, and handles naming a KV endpoint the GEN was
not told about (refused before any connection).
"""

import socket

import msgspec
import pytest
import zmq

from splitserve.errors import InvalidRequestError
from splitserve.kv.messages import PullAck, PullRequest, TcpPullReply
from splitserve.protocol.engine import RemotePrefill

from disagg_utils import GREEDY, PROMPT, engine, handoff, wait_for_release
from kv_fault_utils import (assert_healthy, close_engines, connections_to, greedy_reference,
                            pull_with)
from engine_requests import add_request

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


def test_a_handle_with_another_prompts_digest_pulls_nothing(pair, want, dealer):
    """A digest swapped into a real handle (to match forged relayed tokens) is refused by the
    CTX itself, which compares it with the digest it stored with the lease."""
    ctx, gen = pair
    delta = handoff(ctx, "dig")
    h = delta.kv_handle
    assert len(h.prompt_digest) == 32
    dealer.connect(h.endpoint)
    (frame,) = ask(dealer, ctx_request_id=h.ctx_request_id, layout=h.layout,
                   lease_token=h.lease_token, prompt_digest="0" * 32)
    assert "unknown or expired" in msgspec.msgpack.decode(frame, type=TcpPullReply).error
    assert ctx.remote_kv.num_leased_blocks == NUM_BLOCKS
    assert pull_with(gen, "dig", delta) == want
    wait_for_release(ctx)
    assert_healthy(ctx, gen)


# -- KV endpoints a GEN may dial --------------------------------------------------------------

@pytest.fixture
def listener():
    """A TCP socket listening on loopback that nothing should ever connect to."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        sock.settimeout(1.0)
        yield sock


def assert_refused_endpoint(gen, handle, first_tokens):
    with pytest.raises(InvalidRequestError) as err:
        add_request(gen, "outside", PROMPT, GREEDY, remote=RemotePrefill(handle, first_tokens))
    assert err.value.param == "disaggregated_params.kv_handle"
    assert "--kv-peers" in str(err.value)
    host, port = handle.endpoint.removeprefix("tcp://").rsplit(":", 1)
    assert host not in str(err.value) and port not in str(err.value)   # not echoed


def test_a_gen_dials_only_its_kv_peers(tiny_source, pair, want, listener):
    ctx, _ = pair
    gen = engine(tiny_source, peers=(ctx.remote_kv.endpoint,))
    try:
        delta = handoff(ctx, "peers")
        port = listener.getsockname()[1]
        outside = msgspec.structs.replace(delta.kv_handle, endpoint=f"tcp://127.0.0.1:{port}")
        assert_refused_endpoint(gen, outside, delta.token_ids)
        for _ in range(5):
            gen.step()
        with pytest.raises(socket.timeout):
            listener.accept()   # no connection was attempted
        assert connections_to(port) == 0
        assert pull_with(gen, "peers", delta) == want   # its one peer serves as before
        wait_for_release(ctx)
        assert_healthy(ctx, gen)
    finally:
        close_engines(gen)


@pytest.mark.parametrize("endpoint", ["tcp://10.1.2.3:5555", "tcp://example.com:80",
                                      "tcp://0.0.0.0:5555", "tcp://[fe80::1]:5555"])
def test_without_kv_peers_only_loopback_endpoints_are_dialed(pair, endpoint):
    ctx, gen = pair
    delta = handoff(ctx, "loopback-only")
    assert_refused_endpoint(gen, msgspec.structs.replace(delta.kv_handle, endpoint=endpoint),
                            delta.token_ids)
    assert gen.block_manager.num_free_blocks == gen.block_manager.num_blocks
    ctx.remote_kv.leases.release(delta.kv_handle.ctx_request_id, delta.kv_handle.lease_token)
    wait_for_release(ctx)
