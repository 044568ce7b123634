import numpy as np
import pytest

from splitserve.engine.block_manager import BlockManager, chain_hash
from splitserve.engine.request import Request
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens


def req(tokens, rid="r"):
    return Request(rid, PromptTokens.from_list(tokens), SamplingParams())


def test_allocate_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = req(range(10))
    assert bm.allocate(a, 10)
    assert len(a.block_ids) == 3 and bm.num_free_blocks == 1
    b = req(range(8), "b")
    assert not bm.allocate(b, 8)
    assert b.block_ids == [] and bm.num_free_blocks == 1
    bm.free(a)
    assert bm.num_free_blocks == 4 and all(c == 0 for c in bm.ref_counts)


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req(range(12))
    assert bm.find_cached_prefix(a) == []
    bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    # Same 12 tokens: only 2 blocks may hit, the last token must be recomputed.
    b = req(range(12), "b")
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_ids[:2]
    # A prompt that diverges in its second block hits only the first.
    c = req(list(range(4)) + [99] * 8, "c")
    assert bm.find_cached_prefix(c) == a.block_ids[:1]
    assert bm.allocate(b, 4, hits)
    assert b.block_ids[:2] == a.block_ids[:2] and bm.ref_counts[a.block_ids[0]] == 2
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_freed_cached_block_is_reused_until_evicted():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = req(range(9))
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    first = a.block_ids[0]
    bm.free(a)
    b = req(range(9), "b")
    assert bm.find_cached_prefix(b)[0] == first
    # Filling the cache with other tokens evicts the cached blocks.
    c = req([7] * 12, "c")
    assert bm.allocate(c, 12)
    assert bm.find_cached_prefix(b) == []


def test_chain_hash_depends_on_parent():
    t = np.arange(4, dtype=np.int32)
    assert chain_hash(b"", t) != chain_hash(chain_hash(b"", t), t)
    assert chain_hash(b"", t) == chain_hash(b"", t.copy())


def test_fork_copies_partial_block_only():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = req(range(6))
    bm.allocate(a, 6)
    a.num_computed_tokens = 6
    child = req(range(6), "child")
    src, dst = bm.fork(a, child)
    assert child.block_ids[0] == a.block_ids[0] and bm.ref_counts[a.block_ids[0]] == 2
    assert src == a.block_ids[1] and dst == child.block_ids[1] and dst != src
    bm.free(a)
    bm.free(child)
    assert bm.num_free_blocks == 6


def test_double_free_is_caught():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = req(range(3))
    bm.allocate(a, 3)
    ids = list(a.block_ids)
    bm.free(a)
    a.block_ids = ids
    with pytest.raises(AssertionError):
        bm.free(a)
