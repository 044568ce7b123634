"""Block manager: ref-counted KV blocks, prefix caching by chained block hashes.

Invariants: a block is either referenced (ref_count > 0, not in the free queue) or free
(ref_count == 0, in the free queue). A free block may still hold a cached prefix; it stays
findable by its hash until it is handed out again, oldest-freed first (LRU). A holder (a
request or a KV lease) keeps its blocks in an int64 array that lists each of them once and
is replaced, never written in place; so a request's blocks are counted, queued and handed
out with a few numpy operations rather than one Python step per block.
"""

from __future__ import annotations

import itertools

import numpy as np

from splitserve.engine.free_block_queue import FreeBlockQueue
from splitserve.engine.request import NO_BLOCKS, Request
from splitserve.protocol.block_hashes import chain_hashes, prompt_digest


def _extended(held: np.ndarray, more: np.ndarray) -> np.ndarray:
    """A holder's new block array; a holder with none takes `more` itself, uncopied."""
    return np.concatenate([held, more]) if len(held) else more


class BlockManager:
    """`cached[h] == b` exactly when `block_hash[b] == h`, and then `_hashed[b]` is set: a
    block holds at most one hash, a hash names at most one block."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        self.free_queue = FreeBlockQueue(num_blocks)
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._hashed = np.zeros(num_blocks, dtype=bool)   # finds hashed blocks in bulk
        self.cached: dict[bytes, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Bumped whenever `cached` gains or loses a hash: a report of the cached hashes
        # (engine/kv_report.py) is sent only when this moved.
        self.cache_version = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ---------------------------------------------------------------------
    def _extend_hashes(self, req: Request, num_tokens: int) -> None:
        """Hash every full block of the first num_tokens tokens not hashed yet."""
        bs, done = self.block_size, len(req.block_hashes)
        if done < num_tokens // bs:
            parent = req.block_hashes[-1] if done else req.hash_root
            req.block_hashes += chain_hashes(parent, req.token_slice(done * bs, num_tokens), bs)

    def prompt_hashes(self, req: Request) -> list[bytes]:
        """The chained hashes of req's full prompt blocks (hashed now if not yet)."""
        self._extend_hashes(req, req.num_prompt_tokens)
        return req.block_hashes[:req.num_prompt_tokens // self.block_size]

    def prompt_digest(self, req: Request) -> str:
        """protocol/block_hashes.py's digest of req's prompt, from its block hashes."""
        return prompt_digest(req.prompt.array, self.block_size, self.prompt_hashes(req),
                             req.hash_root)

    def find_cached_prefix(self, req: Request) -> np.ndarray:
        """Blocks holding the longest cached prefix of req's tokens. At least one token is
        always left to compute, so the request has logits to sample from."""
        if not self.enable_prefix_caching or req.prompt.is_placeholder:
            return NO_BLOCKS
        self._extend_hashes(req, req.num_tokens)
        return self._lookup(req, req.block_hashes[: (req.num_tokens - 1) // self.block_size])

    def find_pulled_prefix(self, req: Request) -> np.ndarray:
        """generation_only: blocks holding the longest cached prefix of req's full prompt
        blocks, by the hashes it came with (of its relayed tokens, or the context worker's for
        a length-only prompt; none: no lookup); its KV pull skips them. Every full block may
        hit: the context worker sampled the first token, nothing is computed here."""
        if not self.enable_prefix_caching:
            return NO_BLOCKS
        return self._lookup(req, req.block_hashes[:req.num_prompt_tokens // self.block_size])

    def _lookup(self, req: Request, hashes: list[bytes]) -> np.ndarray:
        hits = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += req.num_prompt_tokens
        self.prefix_hits += len(hits) * self.block_size
        return np.array(hits, dtype=np.int64)

    def cache_full_blocks(self, req: Request) -> None:
        """Publish req's blocks that are full of computed KV under their chained hashes. A
        length-only prompt has only the hashes it came with: its full prompt blocks."""
        if not self.enable_prefix_caching:
            return
        n_full = req.num_computed_tokens // self.block_size
        if req.prompt.is_placeholder:
            n_full = min(n_full, len(req.block_hashes))
        else:
            self._extend_hashes(req, req.num_computed_tokens)
        blocks = req.block_ids[:n_full]
        # Runs every step: blocks that hold a hash already (published on an earlier step, or
        # prefix hits) are skipped in bulk.
        for i in np.flatnonzero(~self._hashed[blocks]).tolist():
            block, h = int(blocks[i]), req.block_hashes[i]
            if h not in self.cached:
                self.block_hash[block] = h
                self._hashed[block] = True
                self.cached[h] = block
                self.cache_version += 1

    def newest_cached_hashes(self, limit: int) -> list[bytes]:
        """Up to `limit` cached hashes, the most recently cached ones (dicts keep insertion
        order): what a router can count on finding here a little later."""
        if len(self.cached) <= limit:
            return list(self.cached)
        return list(itertools.islice(reversed(self.cached), limit))

    # -- allocation -----------------------------------------------------------------------
    def allocate(self, req: Request, num_new_tokens: int,
                 cached_blocks: np.ndarray = NO_BLOCKS) -> bool:
        """Give req blocks for num_computed_tokens + num_new_tokens (after taking
        cached_blocks for its prefix). All or nothing: False leaves every count untouched."""
        have = len(req.block_ids) + len(cached_blocks)
        total = req.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        need = max(self.blocks_needed(total) - have, 0)
        # The guards skip numpy calls on empty arrays: a decode step allocates for every
        # running request and rarely needs a block.
        num_reused = 0
        if len(cached_blocks):
            counts = self.ref_counts[cached_blocks]
            reused = cached_blocks[counts == 0]   # free blocks that still hold the cached prefix
            num_reused = len(reused)
        if need + num_reused > len(self.free_queue):
            return False
        if len(cached_blocks):
            self.free_queue.remove(reused)
            self.ref_counts[cached_blocks] = counts + 1
            req.block_ids = _extended(req.block_ids, cached_blocks)
        if need:
            req.block_ids = _extended(req.block_ids, self._hand_out(need))
        return True

    def _hand_out(self, n: int) -> np.ndarray:
        """The n least recently freed blocks, one reference each, no longer cached."""
        blocks = self.free_queue.pop(n)
        self.ref_counts[blocks] = 1
        if self.cached:
            self._evict(blocks[self._hashed[blocks]])
        return blocks

    def _evict(self, blocks: np.ndarray) -> None:
        """Forget the prefixes these blocks hold: their KV is about to be overwritten."""
        self._hashed[blocks] = False
        self.cache_version += 1
        for block in blocks.tolist():
            del self.cached[self.block_hash[block]]
            self.block_hash[block] = None

    def free(self, req: Request) -> None:
        self.free_blocks(req.block_ids)
        req.block_ids = NO_BLOCKS

    def free_blocks(self, blocks: np.ndarray) -> None:
        """Drop one reference to each block (int64, as handed out, each listed once)."""
        if not len(blocks):
            return
        left = self.ref_counts[blocks] - 1
        shared = np.count_nonzero(left) > 0      # else every one of them is free now
        assert not shared or left.min() >= 0, f"block {blocks[left.argmin()]} freed twice"
        self.ref_counts[blocks] = left
        # Tail blocks first, so a prompt's deepest blocks are evicted before its shared head.
        if shared:
            self.free_queue.push(blocks[::-1][left[::-1] == 0])
        else:
            self.free_queue.push(blocks[::-1].copy())

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """Child shares parent's full blocks; a partial last block is copied (copy-on-write
        done eagerly). Returns (src, dst) block ids to copy, or None. Caller checked space."""
        n_full = parent.num_computed_tokens // self.block_size
        shared = parent.block_ids[:n_full]
        child.block_hashes = parent.block_hashes[:n_full]
        # The parent holds these blocks, so none of them is in the free queue.
        self.ref_counts[shared] += 1
        if len(parent.block_ids) == n_full:
            child.block_ids = shared.copy()
            return None
        child.block_ids = np.concatenate([shared, self._hand_out(1)])
        return int(parent.block_ids[n_full]), int(child.block_ids[-1])
