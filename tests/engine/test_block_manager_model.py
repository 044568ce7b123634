"""Property: under random allocate / cache / decode / fork / free sequences the block manager
hands out, counts, caches and queues blocks exactly like a per-block model built on plain
Python lists and dicts."""

import numpy as np
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.request import Request
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens

BS, NUM_BLOCKS = 4, 12
# Prompts are prefixes of a few fixed sequences, so prefix-cache hits are common.
BASES = [np.random.default_rng(seed).integers(0, 3, 40).tolist() for seed in range(3)]


class ModelBlocks:
    """One block at a time: the free list is a Python list, oldest-freed first."""

    def __init__(self):
        self.refs = [0] * NUM_BLOCKS
        self.free = list(range(NUM_BLOCKS))
        self.hash_of: dict[int, bytes] = {}
        self.cached: dict[bytes, int] = {}

    def allocate(self, hits: list[int], need: int) -> list[int] | None:
        if need + sum(self.refs[b] == 0 for b in hits) > len(self.free):
            return None
        for b in hits:
            if self.refs[b] == 0:
                self.free.remove(b)
            self.refs[b] += 1
        new = [self.free.pop(0) for _ in range(need)]
        for b in new:
            self.refs[b] = 1
            if b in self.hash_of:
                del self.cached[self.hash_of.pop(b)]
        return hits + new

    def hits(self, hashes: list[bytes]) -> list[int]:
        out = []
        for h in hashes:
            if h not in self.cached:
                break
            out.append(self.cached[h])
        return out

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)

    def publish(self, req: Request) -> None:
        n_full = req.num_computed_tokens // BS
        for b, h in zip(req.block_ids[:n_full].tolist(), req.block_hashes[:n_full]):
            if b not in self.hash_of and h not in self.cached:
                self.hash_of[b], self.cached[h] = h, b


class BlockManagerMatchesModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS)
        self.model = ModelBlocks()
        self.running: list[Request] = []

    def _allocate(self, r: Request, n: int, hits: np.ndarray) -> bool:
        total = r.num_computed_tokens + len(hits) * BS + n
        need = max(-(-total // BS) - len(r.block_ids) - len(hits), 0)
        expected = self.model.allocate(hits.tolist(), need)
        before = r.block_ids.tolist()
        assert self.bm.allocate(r, n, hits) == (expected is not None)
        assert r.block_ids.dtype == np.int64
        assert r.block_ids.tolist() == before + (expected or [])
        if expected is not None:
            r.num_computed_tokens = total
            self.bm.cache_full_blocks(r)
            self.model.publish(r)
        return expected is not None

    @rule(base=st.integers(0, 2), length=st.integers(1, 30), use_cache=st.booleans())
    def admit(self, base, length, use_cache):
        r = Request(f"r{len(self.running)}", PromptTokens.from_list(BASES[base][:length]),
                    SamplingParams())
        hits = self.bm.find_cached_prefix(r) if use_cache else np.empty(0, np.int64)
        if use_cache:
            assert hits.tolist() == self.model.hits(r.block_hashes[:(length - 1) // BS])
        if self._allocate(r, length - len(hits) * BS, hits):
            self.running.append(r)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 99), token=st.integers(0, 2))
    def decode(self, i, token):
        r = self.running[i % len(self.running)]
        r.output_token_ids.append(token)
        if not self._allocate(r, 1, np.empty(0, np.int64)):
            r.output_token_ids.pop()

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 99))
    def finish(self, i):
        r = self.running.pop(i % len(self.running))
        self.model.release(r.block_ids.tolist())
        self.bm.free(r)

    @precondition(lambda self: self.running and self.bm.num_free_blocks > 0)
    @rule(i=st.integers(0, 99))
    def fork(self, i):
        parent = self.running[i % len(self.running)]
        child = Request("child", parent.prompt, SamplingParams())
        child.output_token_ids = list(parent.output_token_ids)
        n_full = parent.num_computed_tokens // BS
        partial = len(parent.block_ids) > n_full
        expected = self.model.allocate(parent.block_ids[:n_full].tolist(), int(partial))
        copy = self.bm.fork(parent, child)
        assert child.block_ids.tolist() == expected
        assert copy == ((parent.block_ids[n_full], expected[-1]) if partial else None)
        child.num_computed_tokens = parent.num_computed_tokens
        self.running.append(child)

    @invariant()
    def same_state(self):
        assert self.bm.free_queue.order() == self.model.free
        assert self.bm.ref_counts.tolist() == self.model.refs
        assert self.bm.cached == self.model.cached
        assert self.bm.num_free_blocks == len(self.model.free)
        assert self.bm.num_used_blocks == NUM_BLOCKS - len(self.model.free)


BlockManagerMatchesModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                                      deadline=None)
test_block_manager_matches_model = BlockManagerMatchesModel.TestCase
