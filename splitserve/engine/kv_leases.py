"""KV leases: a context_only request's blocks, held for a generation worker to pull.

The engine thread owns the table and every block-manager call; transport threads only
read a lease (lookup) and ask for its release, which is queued and applied by the engine
thread. A lease ends on the GEN's ack or when it expires: a dead GEN leaks nothing.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from splitserve.kv.base import LeaseView


@dataclass
class Lease:
    block_ids: np.ndarray     # int64; the lease holds one reference to each
    num_tokens: int
    expires_at: float
    sending: bool = field(default=False)


class LeaseTable(LeaseView):
    def __init__(self, lease_seconds: float, wake=lambda: None):
        self.lease_seconds = lease_seconds
        self.leases: dict[str, Lease] = {}
        self.released: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = wake   # tells an idle engine loop there is work
        self._lock = threading.Lock()
        self._watchers: list[tuple] = []   # (started, ended): see LeaseView.watch

    def watch(self, started, ended) -> None:
        self._watchers.append((started, ended))

    def add(self, ctx_request_id: str, block_ids: np.ndarray, num_tokens: int) -> None:
        """Takes over block_ids: the caller holds neither the array nor its references."""
        for started, _ in self._watchers:
            started(ctx_request_id, block_ids)
        with self._lock:
            self.leases[ctx_request_id] = Lease(block_ids, num_tokens,
                                                time.monotonic() + self.lease_seconds)

    # -- transport threads ----------------------------------------------------------------
    def lookup(self, ctx_request_id: str) -> tuple[np.ndarray, int] | None:
        with self._lock:
            lease = self.leases.get(ctx_request_id)
            if lease is None:
                return None
            lease.sending = True    # not expired under an in-flight send
            return lease.block_ids, lease.num_tokens

    def release(self, ctx_request_id: str) -> None:
        self.released.put(ctx_request_id)
        self.wake()

    # -- engine thread --------------------------------------------------------------------
    def collect(self, now: float | None = None) -> list[np.ndarray]:
        """Block arrays whose lease ended (acked, or expired and not mid-send)."""
        now = time.monotonic() if now is None else now
        done = {}
        with self._lock:
            while not self.released.empty():
                rid = self.released.get()
                if rid in self.leases:
                    done[rid] = self.leases.pop(rid).block_ids
            for rid in [r for r, l in self.leases.items() if l.expires_at <= now and
                        (not l.sending or l.expires_at + self.lease_seconds <= now)]:
                done[rid] = self.leases.pop(rid).block_ids
        for rid in done:
            for _, ended in self._watchers:
                ended(rid)
        return list(done.values())

    @property
    def num_leased_blocks(self) -> int:
        with self._lock:
            return sum(len(l.block_ids) for l in self.leases.values())

    def next_expiry(self) -> float | None:
        with self._lock:
            return min((l.expires_at for l in self.leases.values()), default=None)
