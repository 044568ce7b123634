"""What the engine tells its front-end about its prefix cache: the chained hashes of the
blocks it holds (protocol/engine.py KVBlocks), which the worker serves on
GET /internal/kv_blocks for the orchestrator's KV-aware router (orchestrator/kv_index.py).

A snapshot, not a stream of events: a router that misses one loses nothing, and a restarted
engine (or front-end) starts over from the next one. It is sent only when the cache changed,
at most once per `every` seconds, so a busy engine pays for one list of at most `limit`
hashes a second, not one per step."""

from __future__ import annotations

import os
import time

from splitserve.engine.block_manager import BlockManager
from splitserve.protocol.engine import KVBlocks

# 16,384 hashes: 256 KiB a snapshot, 64 Ki tokens of prefixes at block size 4 and 256 Ki at
# 16; a router polling it every couple of seconds reads ~100 KiB/s per worker at most.
MAX_REPORTED_BLOCKS = 16384


class CacheReporter:
    def __init__(self, block_manager: BlockManager, every: float = 1.0,
                 limit: int = MAX_REPORTED_BLOCKS):
        self.bm, self.every, self.limit = block_manager, every, limit
        self._boot = os.urandom(4).hex()     # versions of a restarted engine never repeat
        self._sent: int | None = None
        self._next = 0.0

    def due(self) -> KVBlocks | None:
        """A snapshot if the cache changed since the last one and `every` has passed."""
        version, now = self.bm.cache_version, time.monotonic()
        if version == self._sent or now < self._next:
            return None
        self._sent, self._next = version, now + self.every
        hashes = self.bm.newest_cached_hashes(self.limit)
        return KVBlocks(f"{self._boot}-{version}", self.bm.block_size, len(self.bm.cached),
                        b"".join(hashes))
