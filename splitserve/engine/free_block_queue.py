"""Free KV blocks in the order they were freed, with bulk push, pop and remove.

The block manager hands out the least recently freed block first, so a free block that
still holds a cached prefix stays findable for as long as possible. A large request frees
and takes thousands of blocks at once; this queue does each of those in a few numpy
operations instead of one Python step per block.
"""

from __future__ import annotations

import numpy as np


class FreeBlockQueue:
    """FIFO of distinct block ids. Owned by one BlockManager, which decides which blocks are
    free; the queue trusts it (pushing a queued block or removing an absent one is a bug).

    Layout: `_slots[_head:_tail]` holds the queue, oldest first. Removing a block from the
    middle (a prefix-cache hit on a free block) leaves a hole (-1) that pops step over.
    `_slots` is twice the number of blocks long; when a push would run past the end the
    holes are squeezed out, which leaves room for at least num_blocks more pushes.
    """

    def __init__(self, num_blocks: int):
        self._slots = np.full(2 * num_blocks, -1, dtype=np.int64)
        self._slots[:num_blocks] = np.arange(num_blocks)
        self._where = np.arange(num_blocks, dtype=np.int64)  # slot of each queued block
        self._head, self._tail = 0, num_blocks
        self._holes = 0          # -1 entries in _slots[_head:_tail]

    def __len__(self) -> int:
        return self._tail - self._head - self._holes

    def order(self) -> list[int]:
        """The queued blocks, oldest first."""
        queued = self._slots[self._head:self._tail]
        return queued[queued >= 0].tolist()

    def push(self, blocks: np.ndarray) -> None:
        """Append blocks (int64, none of them queued) at the newest end, in the given order.
        Pass a contiguous array: numpy scatters through a reversed view at half the speed."""
        if self._tail + len(blocks) > len(self._slots):
            self._squeeze()
        end = self._tail + len(blocks)
        self._slots[self._tail:end] = blocks
        self._where[blocks] = np.arange(self._tail, end)
        self._tail = end

    def pop(self, n: int) -> np.ndarray:
        """Remove the n oldest blocks; return them, oldest first, as an int64 array the
        caller owns. The caller checked len(self) >= n."""
        head = self._head
        if self._holes == 0 or self._slots[head:head + n].min(initial=0) >= 0:
            self._head = head + n
            return self._slots[head:head + n].copy()
        width = 2 * n        # doubled until it covers n live blocks: cost O(n + holes passed)
        while True:
            window = self._slots[head:min(head + width, self._tail)]
            live = np.flatnonzero(window >= 0)
            if len(live) >= n:
                break
            width *= 2
        end = int(live[n - 1]) + 1
        self._holes -= end - n
        self._head = head + end
        return window[live[:n]]

    def remove(self, blocks: np.ndarray) -> None:
        """Take queued blocks out, wherever they stand."""
        self._slots[self._where[blocks]] = -1
        self._holes += len(blocks)

    def _squeeze(self) -> None:
        queued = self._slots[self._head:self._tail]
        if self._holes:
            queued = queued[queued >= 0]
            self._where[queued] = np.arange(len(queued))
        else:
            # Every queued block moves by the same amount. Shifting all of _where (blocks not
            # queued have no meaningful slot) is far cheaper than scattering into it.
            self._where -= self._head
        self._slots[:len(queued)] = queued
        self._head, self._tail, self._holes = 0, len(queued), 0
