"""Per-block checksums of pulled KV: the CTX computes one for each block it offers, the GEN
checks each block it received against it before the pull counts as done.

A mismatch (a flipped bit on the wire, a NIC or a buffer that corrupted a block in flight)
fails the pull like any other failed pull: the request's blocks are freed, never decoded and
never entered in the prefix cache, and the orchestrator's retry prefills again. The sum is
xxh3_64 (the fastest of xxh3_64, crc32c, xxh64, xxh32 and zlib.crc32 measured on this
project's machines; docs/benchmarks.md has the cost), 8 little-endian bytes per block in the
reply. Both ends run it on the KV transport's threads, never on an event loop.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import xxhash

from splitserve.kv.sockets import BadReply

SUM_BYTES = 8   # per block, in PullReply.block_sums


class ChecksumMismatch(BadReply):
    """A block's bytes are not those the CTX summed. Blocks of this pull may have been
    written; the engine frees them with the failed request, so none is ever read."""


def block_sum(block) -> int:
    """xxh3_64 of one block's bytes (any buffer: a memoryview, a ZeroMQ frame's buffer)."""
    return xxhash.xxh3_64_intdigest(block)


def block_sums(blocks: Iterable) -> bytes:
    """The reply's block_sums field for these blocks, in order."""
    return np.fromiter((block_sum(b) for b in blocks), dtype="<u8").tobytes()


def expected_sums(sums: bytes, count: int) -> list[int]:
    """The sums a reply carries, as ints; BadReply unless it holds exactly `count`."""
    if len(sums) != SUM_BYTES * count:
        raise BadReply(f"the context worker sent {len(sums)} bytes of block checksums for "
                       f"{count} KV blocks, expected {SUM_BYTES * count}")
    return np.frombuffer(sums, dtype="<u8").tolist()


def check_block(index: int, block, want: int) -> None:
    if block_sum(block) != want:
        raise ChecksumMismatch(f"KV block {index} arrived corrupted (its checksum is not the "
                               f"context worker's)")
