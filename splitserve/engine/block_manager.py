"""Block manager: ref-counted KV blocks, prefix caching by chained block hashes.

Invariants: a block is either referenced (ref_count > 0, not in the free queue) or free
(ref_count == 0, in the free queue). A free block may still hold a cached prefix; it stays
findable by its hash until it is handed out again, oldest-freed first (LRU).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from splitserve.engine.request import Request


def chain_hash(parent: bytes, tokens: np.ndarray) -> bytes:
    """Stable across processes (unlike hash()), so another worker can compute the same keys."""
    return hashlib.blake2b(parent + tokens.astype("<i4", copy=False).tobytes(),
                           digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

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
        bs = self.block_size
        for i in range(len(req.block_hashes), num_tokens // bs):
            parent = req.block_hashes[-1] if req.block_hashes else b""
            req.block_hashes.append(chain_hash(parent, req.token_slice(i * bs, (i + 1) * bs)))

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Blocks holding the longest cached prefix of req's tokens. At least one token is
        always left to compute, so the request has logits to sample from."""
        if not self.enable_prefix_caching or req.prompt.is_placeholder:
            return []
        self._extend_hashes(req, req.num_tokens)
        hits = []
        for h in req.block_hashes[: (req.num_tokens - 1) // self.block_size]:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += req.num_prompt_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits

    def cache_full_blocks(self, req: Request) -> None:
        """Publish req's blocks that are full of computed KV under their chained hashes."""
        if not self.enable_prefix_caching or req.prompt.is_placeholder:
            return
        n_full = req.num_computed_tokens // self.block_size
        self._extend_hashes(req, req.num_computed_tokens)
        for i in range(n_full):
            block, h = req.block_ids[i], req.block_hashes[i]
            if self.block_hash[block] is None and h not in self.cached:
                self.block_hash[block] = h
                self.cached[h] = block

    # -- allocation -----------------------------------------------------------------------
    def allocate(self, req: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give req blocks for num_computed_tokens + num_new_tokens (after taking
        cached_blocks for its prefix). All or nothing: False leaves every count untouched."""
        reusable = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        have = len(req.block_ids) + len(cached_blocks)
        total = req.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        need = max(self.blocks_needed(total) - have, 0)
        if need + reusable > len(self.free_queue):
            return False
        for b in cached_blocks:
            self._take(b)
        req.block_ids.extend(cached_blocks)
        for _ in range(need):
            block, _ = self.free_queue.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            req.block_ids.append(block)
        return True

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
        self.ref_counts[block] += 1

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]

    def free(self, req: Request) -> None:
        self.free_blocks(req.block_ids)
        req.block_ids = []

    def free_blocks(self, block_ids: list[int]) -> None:
        # Tail blocks first, so a prompt's deepest blocks are evicted before its shared head.
        for block in reversed(block_ids):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """Child shares parent's full blocks; a partial last block is copied (copy-on-write
        done eagerly). Returns (src, dst) block ids to copy, or None. Caller checked space."""
        n_full = parent.num_computed_tokens // self.block_size
        for b in parent.block_ids[:n_full]:
            self._take(b)
        child.block_ids = list(parent.block_ids[:n_full])
        child.block_hashes = list(parent.block_hashes[:n_full])
        if len(parent.block_ids) == n_full:
            return None
        block, _ = self.free_queue.popitem(last=False)
        self._evict(block)
        self.ref_counts[block] = 1
        child.block_ids.append(block)
        return parent.block_ids[n_full], block
