import numpy as np
import pytest

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.request import Request
from splitserve.protocol.block_hashes import chain_hash
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens


def req(tokens, rid="r"):
    return Request(rid, PromptTokens.from_list(tokens), SamplingParams())


def computed(bm, tokens, rid="r"):
    """A request whose every token has its KV in blocks, the full ones published."""
    r = req(tokens, rid)
    assert bm.allocate(r, r.num_prompt_tokens)
    r.num_computed_tokens = r.num_prompt_tokens
    bm.cache_full_blocks(r)
    return r


def test_allocate_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = req(range(10))
    assert bm.allocate(a, 10)
    assert len(a.block_ids) == 3 and bm.num_free_blocks == 1
    b = req(range(8), "b")
    assert not bm.allocate(b, 8)
    assert b.block_ids.tolist() == [] and bm.num_free_blocks == 1
    bm.free(a)
    assert bm.num_free_blocks == 4 and all(c == 0 for c in bm.ref_counts)


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req(range(12))
    assert bm.find_cached_prefix(a).tolist() == []
    bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    # Same 12 tokens: only 2 blocks may hit, the last token must be recomputed.
    b = req(range(12), "b")
    hits = bm.find_cached_prefix(b)
    assert hits.tolist() == a.block_ids[:2].tolist()
    # A prompt that diverges in its second block hits only the first.
    c = req(list(range(4)) + [99] * 8, "c")
    assert bm.find_cached_prefix(c).tolist() == a.block_ids[:1].tolist()
    assert bm.allocate(b, 4, hits)
    assert np.array_equal(b.block_ids[:2], a.block_ids[:2]) and bm.ref_counts[a.block_ids[0]] == 2
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_freed_cached_block_is_reused_until_evicted():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = computed(bm, range(9))
    first = a.block_ids[0]
    bm.free(a)
    b = req(range(9), "b")
    assert bm.find_cached_prefix(b)[0] == first
    # Filling the cache with other tokens evicts the cached blocks.
    c = req([7] * 12, "c")
    assert bm.allocate(c, 12)
    assert bm.find_cached_prefix(b).tolist() == []


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
    ids = a.block_ids
    bm.free(a)
    a.block_ids = ids
    with pytest.raises(AssertionError):
        bm.free(a)


def test_free_queue_is_lru_with_each_requests_tail_first():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = req(range(12)), req(range(8), "b")
    bm.allocate(a, 12)
    bm.allocate(b, 8)
    assert a.block_ids.tolist() == [0, 1, 2] and b.block_ids.tolist() == [3, 4]
    bm.free(a)
    bm.free(b)
    assert bm.free_queue.order() == [5, 6, 7, 2, 1, 0, 4, 3]
    c = req(range(20), "c")
    assert bm.allocate(c, 20)
    assert c.block_ids.tolist() == [5, 6, 7, 2, 1]
    assert bm.free_queue.order() == [0, 4, 3]


def test_bulk_allocation_evicts_exactly_the_cached_blocks_it_hands_out():
    bm = BlockManager(num_blocks=6, block_size=4)
    bm.free(computed(bm, range(16)))   # queue: 4, 5, then its blocks tail first: 3, 2, 1, 0
    b = req([9] * 16, "b")
    assert bm.allocate(b, 16)      # takes 4, 5, 3, 2: a's two deepest blocks lose their hashes
    assert b.block_ids.tolist() == [4, 5, 3, 2]
    assert sorted(bm.cached.values()) == [0, 1]
    assert bm.find_cached_prefix(req(range(16), "again")).tolist() == [0, 1]


def test_cache_hit_on_free_blocks_takes_them_out_of_the_middle_of_the_queue():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.free(computed(bm, range(12)))
    b = req(range(12), "b")
    hits = bm.find_cached_prefix(b)
    assert hits.tolist() == [0, 1]
    assert bm.allocate(b, 4, hits)
    assert b.block_ids.tolist() == [0, 1, 3] and bm.num_free_blocks == 5
    assert bm.free_queue.order() == [4, 5, 6, 7, 2]
    c = req([9] * 20, "c")
    assert bm.allocate(c, 20) and c.block_ids.tolist() == [4, 5, 6, 7, 2]


def test_fork_counts_every_shared_block_once_per_holder():
    bm = BlockManager(num_blocks=10, block_size=4)
    parent = req(range(14))
    bm.allocate(parent, 14)
    parent.num_computed_tokens = 14
    kids = [req(range(14), f"k{i}") for i in range(2)]
    copies = [bm.fork(parent, kid) for kid in kids]
    assert [int(bm.ref_counts[b]) for b in parent.block_ids] == [3, 3, 3, 1]
    assert [dst for _, dst in copies] == [4, 5]
    bm.free(parent)
    assert [int(bm.ref_counts[b]) for b in kids[0].block_ids[:3]] == [2, 2, 2]
    assert bm.free_queue.order()[-1] == 3      # only the parent's own last block came back
    for kid in kids:
        bm.free(kid)
    assert bm.num_free_blocks == 10 and not bm.ref_counts.any()


def test_freeing_twice_changes_no_count():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = req(range(8))
    bm.allocate(a, 8)
    bm.free_blocks(a.block_ids[:1])
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free_blocks(a.block_ids)
    assert bm.ref_counts.tolist() == [0, 1, 0, 0] and bm.num_free_blocks == 3


class _NoPerBlockPython(np.ndarray):
    """Block ids that fail the test when Python walks them or lists them one by one."""

    def __iter__(self):
        raise AssertionError("block ids iterated one by one")

    def tolist(self):
        raise AssertionError("block ids turned into a list")


def test_a_long_prompt_takes_grows_and_returns_its_blocks_as_arrays():
    """A 128k-token prompt holds 8,192 blocks; none of its block-manager calls may cost a
    Python step per block."""
    bm = BlockManager(num_blocks=8200, block_size=16, enable_prefix_caching=False)
    r = Request("long", PromptTokens.placeholder(131072), SamplingParams())
    assert bm.allocate(r, 131072)
    assert r.block_ids.dtype == np.int64 and np.array_equal(r.block_ids, np.arange(8192))
    r.num_computed_tokens = 131072
    r.block_ids = r.block_ids.view(_NoPerBlockPython)
    assert bm.allocate(r, 1)                          # a decode step starts a new block
    assert np.array_equal(r.block_ids[-2:], [8191, 8192])
    r.block_ids = r.block_ids.view(_NoPerBlockPython)
    bm.free(r)
    assert bm.num_free_blocks == 8200 and not bm.ref_counts.any()
    assert bm.free_queue.order()[-3:] == [2, 1, 0]    # tail first
