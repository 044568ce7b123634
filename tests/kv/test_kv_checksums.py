"""Checksummed KV: a bit flipped in a block while it is in flight fails the pull (tcp and
nixl, real transports on loopback); nothing of it is decoded, its blocks are freed, and a
fresh prefill pulled again (what the orchestrator's retry does) gives the uninterrupted text."""

import numpy as np
import pytest

from splitserve.engine.request import FinishReason
from splitserve.kv.checksums import (ChecksumMismatch, LeaseSums, block_sums, check_block,
                                     expected_sums)
from splitserve.kv.sockets import BadReply

from splitserve.protocol.engine import RemotePrefill

from disagg_utils import (BACKENDS, GREEDY, PROMPT, drain, engine, handoff, require_backend,
                          wait_for_release)
from engine_requests import add_request
from kv_fault_utils import assert_healthy, greedy_reference, pull_with, wait_for


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request, tiny_source):
    require_backend(request.param)
    # The failed pull's lease is never acked: it ends on expiry, 3 s.
    ctx = engine(tiny_source, request.param, lease=3.0)
    gen = engine(tiny_source, request.param, prefix_caching=False)
    yield ctx, gen
    for e in (ctx, gen):
        e.remote_kv.close()


def flip_in_flight(transport, block_index=2, bit=5):
    """The CTX sums the blocks it offers, then one bit of one of them flips before the GEN
    has its bytes (tcp sends frames that view the cache; nixl READs the cache); the bit
    flips back once the offer has left. Returns a function that undoes the wrapping."""
    offer = transport._offer
    flipped = []

    def corrupted(ctx_request_id, blocks):
        reply, frames = offer(ctx_request_id, blocks)
        view = transport.block_bytes(int(blocks[block_index]))
        view[7] ^= 1 << bit
        flipped.append(view)
        return reply, frames
    transport._offer = corrupted

    def undo():
        transport._offer = offer
        for view in flipped:
            view[7] ^= 1 << bit
    return undo


def test_a_flipped_bit_fails_the_pull_and_a_fresh_prefill_gets_the_right_text(pair):
    ctx, gen = pair
    want = greedy_reference(ctx)
    undo = flip_in_flight(ctx.remote_kv.transport)
    try:
        delta = handoff(ctx, "bad")
        add_request(gen, "bad", PROMPT, GREEDY,
                    remote=RemotePrefill(delta.kv_handle, delta.token_ids, delta.logprobs))
        (failed,) = drain(gen)
    finally:
        undo()
    assert failed.finish_reason == FinishReason.ERROR and "corrupted" in failed.error, failed
    assert failed.token_ids == []   # not one token decoded from the corrupted KV
    assert_healthy(gen)             # its blocks are free again
    assert pull_with(gen, "retry", handoff(ctx, "retry")) == want
    wait_for_release(ctx, timeout=10)


def test_checksums_catch_any_single_flipped_bit_of_a_block():
    block = bytearray(range(256)) * 8
    (want,) = expected_sums(block_sums([bytes(block)]), 1)
    check_block(0, bytes(block), want)
    for i in range(0, len(block), 97):
        for bit in range(8):
            block[i] ^= 1 << bit
            with pytest.raises(ChecksumMismatch):
                check_block(0, bytes(block), want)
            block[i] ^= 1 << bit


def test_a_reply_with_the_wrong_count_of_checksums_is_refused():
    with pytest.raises(BadReply, match="16 bytes of block checksums for 3 KV blocks"):
        expected_sums(bytes(16), 3)


def test_lease_sums_are_the_blocks_sums_whether_summed_ahead_or_at_the_offer():
    cache = np.random.default_rng(0).integers(0, 256, (8, 64), dtype=np.uint8)
    sums = LeaseSums(lambda b: memoryview(cache[b]), "test")
    truth = lambda ids: block_sums(memoryview(cache[b]) for b in ids)   # noqa: E731
    blocks = np.array([5, 1, 3, 6])
    assert sums.sums("early", blocks) == truth(blocks)       # no lease event yet: summed now
    sums.thread.start()
    sums.started("a", blocks)
    assert wait_for(lambda: "a" in sums._ready)
    assert sums.sums("a", blocks) == truth(blocks)
    assert sums.sums("a", blocks[1:]) == truth(blocks[1:])   # a pull that skips a block
    cache[3] ^= 1   # the id leased again over other bytes: summed afresh, never reused
    sums.ended("a")
    assert "a" not in sums._ready
    sums.started("a", blocks)
    assert wait_for(lambda: "a" in sums._ready)
    assert sums.sums("a", blocks) == truth(blocks)
    assert sums.sums("a", blocks[::-1]) == truth(blocks[::-1])   # not the lease's: summed now
    sums.close()
    sums.thread.join(timeout=5)
    assert not sums.thread.is_alive()
