"""Checksummed KV: a bit flipped in a block while it is in flight fails the pull (tcp and
nixl, real transports on loopback); nothing of it is decoded, its blocks are freed, and a
fresh prefill pulled again (what the orchestrator's retry does) gives the uninterrupted text."""

import ctypes

import numpy as np
import pytest
import torch

from splitserve.engine.request import FinishReason
from splitserve.kernels import build
from splitserve.kv import checksums
from splitserve.kv.checksums import (ChecksumMismatch, LeaseSums, block_sum, block_sums,
                                     check_block, expected_sums, receive_block,
                                     reference_sum)
from splitserve.kv.sockets import BadReply
from splitserve.platforms import platform_for

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


def _kernel_for(march: str):
    lib = build.build_for("kvsum", march)
    if lib is None:
        pytest.skip("the C kernels cannot be built here")
    lib.kv_sum.restype = lib.kv_copy_sum.restype = ctypes.c_uint64
    lib.kv_sum.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.kv_copy_sum.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return lib


# SSE2 vectors (core2), AVX2 (haswell), and this machine's own: AVX-512 where it has it.
MARCHES = ["native", "haswell", "core2"]


@pytest.mark.parametrize("march", MARCHES)
def test_the_kernel_gives_the_reference_sum_and_copies_exactly_on_every_target(march):
    if build._cpu_flags() and "avx2" not in build._cpu_flags().split() and march == "haswell":
        pytest.skip("no AVX2 here")
    lib = _kernel_for(march)
    rng = np.random.default_rng(7)
    for n in (0, 1, 7, 63, 64, 65, 200, 4096, 368_640, 368_641):
        src = rng.integers(0, 256, n, dtype=np.uint8)
        dst = np.zeros(n + 1, dtype=np.uint8)   # one guard byte past the block
        want = reference_sum(src)
        assert lib.kv_sum(src.ctypes.data, n) == want, n
        assert lib.kv_copy_sum(dst.ctypes.data, src.ctypes.data, n) == want, n
        assert np.array_equal(dst[:n], src) and dst[n] == 0, n


def test_the_sum_of_a_block_is_the_kernels_and_the_references():
    block = np.random.default_rng(1).integers(0, 256, 1000, dtype=np.uint8)
    assert block_sum(memoryview(block)) == reference_sum(block)
    assert reference_sum(b"") != reference_sum(bytes(64))   # the length counts


def test_checksums_catch_two_flipped_bits_of_one_lane_at_any_distance():
    # A Fletcher sum of whole 64-bit words kept mod 2^64 misses a top bit cleared in one
    # step and set in another an even number of steps later (its B moves by 2^63 * distance);
    # in 32-bit words with 64-bit accumulators B moves by 2^31 * distance, never 0.
    block = np.zeros(64 * 70, dtype=np.uint8)
    block[3] = 0x80                     # lane 0's top bit, step 0
    want = block_sum(block)
    for lane_byte in (3, 7, 63):        # the top byte of lanes 0, 1 and 15
        for distance in (1, 2, 4, 32, 64):
            bad = block.copy()
            bad[3] = 0
            bad[64 * distance + lane_byte] ^= 0x80
            assert block_sum(bad) != want, (lane_byte, distance)


def test_checksums_catch_any_burst_of_up_to_a_thousand_bits():
    rng = np.random.default_rng(3)
    block = rng.integers(0, 256, 368_640, dtype=np.uint8)
    want = block_sum(block)
    for _ in range(300):
        bits = int(rng.integers(1, 993))
        start = int(rng.integers(0, 8 * block.size - bits))
        flip = np.zeros(8 * block.size, dtype=np.uint8)
        flip[start] = flip[start + bits - 1] = 1          # a burst's ends flip, the rest at random
        flip[start + 1:start + bits - 1] = rng.integers(0, 2, max(bits - 2, 0))
        assert block_sum(block ^ np.packbits(flip, bitorder="little")) != want


def test_receive_block_copies_the_frame_and_refuses_a_wrong_sum():
    frame = np.random.default_rng(2).integers(0, 256, 4096, dtype=np.uint8)
    block = torch.zeros(4096, dtype=torch.uint8)
    cpu = platform_for("cpu")
    receive_block(cpu, 4, memoryview(frame), block, reference_sum(frame))
    assert np.array_equal(block.numpy(), frame)
    with pytest.raises(ChecksumMismatch, match="KV block 4 arrived corrupted"):
        receive_block(cpu, 4, memoryview(frame), torch.zeros(4096, dtype=torch.uint8),
                      reference_sum(frame) ^ 1)


def test_without_the_c_kernels_the_sums_are_the_same(monkeypatch):
    block = np.random.default_rng(4).integers(0, 256, 5000, dtype=np.uint8)
    want = block_sum(block)

    monkeypatch.setattr(checksums, "_lib", None)
    assert block_sum(block) == want
    dst = torch.zeros(5000, dtype=torch.uint8)
    receive_block(platform_for("cpu"), 0, memoryview(block), dst, want)
    assert np.array_equal(dst.numpy(), block)
