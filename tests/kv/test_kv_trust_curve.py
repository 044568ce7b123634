"""CURVE on the KV channel: with the cluster's secret set, a peer without it gets no message
through to the KV server, not even one carrying a live lease's id and token.

The unauthenticated peers are real ZeroMQ DEALERs on loopback: one without CURVE, one with
keys derived from another secret, one that knows the server's public key but holds a key
pair of its own (refused by the ZAP handler), and a GEN engine with another secret.
"""

import msgspec
import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from splitserve.kv.curve import CurveKeys
from splitserve.kv.messages import PullAck, PullRequest
from splitserve.protocol.engine import RemotePrefill

from disagg_utils import (BACKENDS, GREEDY, PROMPT, drain, engine, handoff, require_backend,
                          wait_for_release)
from kv_fault_utils import (assert_healthy, close_engines, ended_in_error, greedy_reference,
                            pull_with)
from engine_requests import add_request

SECRET = "the cluster's internal secret"
NUM_BLOCKS = 6
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL |
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH)


@pytest.fixture(scope="module")
def pair(tiny_source):
    engines = engine(tiny_source, secret=SECRET), engine(tiny_source, secret=SECRET)
    yield engines
    close_engines(*engines)


@pytest.fixture(scope="module")
def want(pair):
    return greedy_reference(pair[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pull_between_workers_with_the_secret_is_exact(tiny_source, want, backend):
    require_backend(backend)
    ctx = engine(tiny_source, backend, secret=SECRET)
    gen = engine(tiny_source, backend, secret=SECRET)
    try:
        assert pull_with(gen, "g", handoff(ctx, "c")) == want
        wait_for_release(ctx)
        assert_healthy(ctx, gen)
    finally:
        close_engines(ctx, gen)


def no_curve(sock):
    pass


def keys_of_another_secret(sock):
    CurveKeys.from_secret("not " + SECRET).make_client(sock)


def own_keys_but_the_server_key(sock):
    """The strongest outsider: the server's public key leaked, the client pair did not."""
    public, secret = zmq.curve_keypair()
    sock.curve_serverkey = CurveKeys.from_secret(SECRET).server.public
    sock.curve_publickey, sock.curve_secretkey = public, secret


@pytest.mark.parametrize("setup", [no_curve, keys_of_another_secret, own_keys_but_the_server_key])
def test_a_peer_without_the_secret_gets_nothing_through(pair, want, setup):
    ctx, gen = pair
    delta = handoff(ctx, setup.__name__)
    h = delta.kv_handle
    zctx = zmq.Context()
    try:
        sock = zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        setup(sock)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED)
        sock.connect(h.endpoint)
        # Even holding the lease's id and token, nothing it sends reaches the server.
        sock.send(msgspec.msgpack.encode(PullRequest(h.ctx_request_id, h.lease_token, h.layout,
                                                     NUM_BLOCKS, len(PROMPT))))
        sock.send(msgspec.msgpack.encode(PullAck(h.ctx_request_id, h.lease_token)))
        assert monitor.poll(15_000)
        assert recv_monitor_message(monitor)["event"] & HANDSHAKE_FAILED
        assert not sock.poll(1000)   # no answer
        for _ in range(10):
            ctx.step()
        lease = ctx.remote_kv.leases.leases[h.ctx_request_id]
        assert not lease.sending   # never looked up: the request did not reach the server
        assert ctx.remote_kv.num_leased_blocks == NUM_BLOCKS
    finally:
        zctx.destroy(linger=0)
    assert pull_with(gen, setup.__name__, delta) == want   # the lease is intact
    wait_for_release(ctx)
    assert_healthy(ctx, gen)


@pytest.mark.parametrize("gen_secret", [None, "not " + SECRET])
def test_a_gen_without_the_secret_fails_its_pull_at_once(tiny_source, pair, want, gen_secret):
    """connect_timeout of 120 s: only the failed handshake can end the pull within drain's."""
    ctx, gen = pair
    outsider = engine(tiny_source, secret=gen_secret, timeout=120.0, connect_timeout=120.0)
    try:
        delta = handoff(ctx, f"outsider-{gen_secret}")
        before = outsider.runner.kv_cache.clone()
        add_request(outsider, "o", PROMPT, GREEDY, remote=RemotePrefill(delta.kv_handle,
                                                                       delta.token_ids))
        (final,) = drain(outsider, timeout=30)
        assert ended_in_error(final, "refused the handshake"), final.error
        assert torch.equal(outsider.runner.kv_cache, before)
        assert ctx.remote_kv.num_leased_blocks == NUM_BLOCKS
        assert pull_with(gen, f"insider-{gen_secret}", delta) == want
        wait_for_release(ctx)
        assert_healthy(ctx, gen, outsider)
    finally:
        outsider.remote_kv.close()
