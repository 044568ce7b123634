"""Per-block checksums of pulled KV: the CTX computes one for each block it offers, the GEN
checks each block it received against it before the pull counts as done.

A mismatch (a flipped bit on the wire, a NIC or a buffer that corrupted a block in flight)
fails the pull like any other failed pull: the request's blocks are freed, never decoded and
never entered in the prefix cache, and the orchestrator's retry prefills again. The sum is
the C kernel kernels/kvsum.c (a Fletcher sum in sixteen 64-bit lanes folded into 64 bits; 8
little-endian bytes per block in the reply): its GEN side copies a frame into its block and
sums it in the same pass, so the block crosses memory once, and as a ctypes call it
releases the GIL, so neither end's summing stalls the process's other threads. Where the C
kernels cannot be built (no compiler, SPLITSERVE_NATIVE_KERNELS=0) `reference_sum`, the same
sum in numpy, computes it: both ends always agree. docs/tuning.md has why this sum, what it
detects and what it costs. Both ends run it on the KV transport's threads, never on an event
loop. The CTX sums a lease's blocks on a thread of its own as the lease starts (LeaseSums),
so the pull, which comes after the orchestrator's hop to a GEN, usually finds them ready.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from typing import Callable, Iterable

import numpy as np
import torch

from splitserve.kernels import build
from splitserve.kv.sockets import BadReply

SUM_BYTES = 8   # per block, in PullReply.block_sums
LANES = 16      # 32-bit words of a step, one per lane (kvsum.c)
_MASK = (1 << 64) - 1


def _kernel() -> ctypes.CDLL | None:
    lib = build.load("kvsum")
    if lib is not None:
        lib.kv_sum.restype = lib.kv_copy_sum.restype = ctypes.c_uint64
        lib.kv_sum.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.kv_copy_sum.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return lib


_lib = _kernel()


def _address(buffer) -> tuple[int, int]:
    """(address, bytes) of a contiguous buffer (a memoryview, a ZeroMQ frame's buffer). A
    writable one (frames, the cache) through ctypes, several times cheaper than numpy's."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buffer)), memoryview(buffer).nbytes
    except (TypeError, ValueError):   # read-only, or empty
        array = np.frombuffer(buffer, dtype=np.uint8)
        return array.ctypes.data, array.size


def _fmix(k: int) -> int:
    """MurmurHash3's 64-bit finalizer, as kvsum.c's fmix."""
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & _MASK
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & _MASK
    return k ^ (k >> 33)


def reference_sum(block) -> int:
    """kvsum.c's sum in numpy: the block zero-padded to whole steps of sixteen little-endian
    32-bit words; lane l's A is the sum of its words, B the sum of A after each step (so
    word i of s steps counts s - i times), both mod 2^64; then the length, the sixteen A and
    the sixteen B folded in through _fmix."""
    data = np.frombuffer(block, dtype=np.uint8)
    n = data.size
    if n % (4 * LANES):
        data = np.concatenate([data, np.zeros(-n % (4 * LANES), dtype=np.uint8)])
    words = data.view("<u4").reshape(-1, LANES).astype(np.uint64)
    weights = np.arange(len(words), 0, -1, dtype=np.uint64)
    h = _fmix(n)
    for acc in [*words.sum(axis=0).tolist(), *(weights @ words).tolist()]:
        h = _fmix(h ^ acc)
    return h


class ChecksumMismatch(BadReply):
    """A block's bytes are not those the CTX summed. Blocks of this pull may have been
    written; the engine frees them with the failed request, so none is ever read."""


def block_sum(block) -> int:
    """The sum of one block's bytes (any buffer: a memoryview, a ZeroMQ frame's buffer)."""
    if _lib is None:
        return reference_sum(block)
    return _lib.kv_sum(*_address(block))


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
        _mismatch(index)


def receive_block(platform, index: int, frame, block: torch.Tensor, want: int) -> None:
    """GEN: writes a frame of exactly block.numel() bytes into its block; ChecksumMismatch
    (the block may be written) unless the frame's sum is `want`. A CPU block takes the copy
    and the sum in one pass; another is summed first, then staged by the platform."""
    if _lib is not None and block.device.type == "cpu":
        got = _lib.kv_copy_sum(block.data_ptr(), *_address(frame))
    else:
        got = block_sum(frame)
        if got == want:
            platform.host_to_block(frame, block)
    if got != want:
        _mismatch(index)


def _mismatch(index: int):
    raise ChecksumMismatch(f"KV block {index} arrived corrupted (its checksum is not the "
                           f"context worker's)")


class LeaseSums:
    """CTX: each live lease's block checksums, summed on this object's thread as the lease
    starts (LeaseView.watch calls started/ended on the engine thread; leased blocks are not
    written until the lease ends). `sums` answers from them when they are ready and are the
    lease's; otherwise (a pull that came first, a transport without lease events) the serving
    thread sums the blocks itself. A lease id taken again is summed afresh: sums are kept per
    start, never reused across two leases of one id."""

    def __init__(self, block_view: Callable[[int], object], name: str):
        self._view = block_view
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()   # (id, start, blocks) | None: stop
        self._live: dict[str, object] = {}                   # id -> its lease's start
        self._ready: dict[str, tuple[np.ndarray, bytes]] = {}
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"kv-{name}-sums")

    def started(self, ctx_request_id: str, blocks: np.ndarray) -> None:
        start = object()
        with self._lock:
            self._live[ctx_request_id] = start
            self._ready.pop(ctx_request_id, None)
        self._jobs.put((ctx_request_id, start, blocks))

    def ended(self, ctx_request_id: str) -> None:
        with self._lock:
            self._live.pop(ctx_request_id, None)
            self._ready.pop(ctx_request_id, None)

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            ctx_request_id, start, blocks = job
            with self._lock:
                if self._live.get(ctx_request_id) is not start:
                    continue   # ended before its turn
            sums = self._sum(blocks)
            with self._lock:
                if self._live.get(ctx_request_id) is start:
                    self._ready[ctx_request_id] = (blocks, sums)

    def sums(self, ctx_request_id: str, blocks: np.ndarray) -> bytes:
        """The block_sums of `blocks`, the lease's from some skip on (serving thread)."""
        with self._lock:
            entry = self._ready.get(ctx_request_id)
        if entry is not None:
            leased, sums = entry
            skip = len(leased) - len(blocks)
            if skip >= 0 and np.array_equal(leased[skip:], blocks):
                return sums[SUM_BYTES * skip:]
        return self._sum(blocks)

    def _sum(self, blocks: np.ndarray) -> bytes:
        return block_sums(self._view(b) for b in blocks.tolist())
