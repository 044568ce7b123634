"""KV leases: a context_only request's blocks, held for a generation worker to pull.

The engine thread owns the table and every block-manager call; transport threads only
read a lease (lookup) and ask for its release, which is queued and applied by the engine
thread. A lease ends on the GEN's ack or when it expires: a dead GEN leaks nothing.
Each lease has an unguessable token, handed out only in its KVHandle: a lookup or ack with
the right id but another token is answered as if the lease did not exist. A lookup that
names a prompt digest other than the lease's is answered the same way, so a handle whose
digest was swapped for another prompt's pulls nothing.
"""

from __future__ import annotations

import hmac
import queue
import secrets
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
    token: str
    digest: str = ""          # protocol/block_hashes.py's digest of the leased prompt
    tokens: np.ndarray | None = None   # the prompt's int32 ids (read-only), for GENs that ask
    sending: bool = field(default=False)


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


class LeaseTable(LeaseView):
    def __init__(self, lease_seconds: float, wake=lambda: None):
        self.lease_seconds = lease_seconds
        self.leases: dict[str, Lease] = {}
        self.released: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = wake   # tells an idle engine loop there is work
        self._lock = threading.Lock()
        self._superseded: list[tuple[str, np.ndarray]] = []   # same id leased again
        self._watchers: list[tuple] = []   # (started, ended): see LeaseView.watch

    def watch(self, started, ended) -> None:
        self._watchers.append((started, ended))

    def add(self, ctx_request_id: str, block_ids: np.ndarray, num_tokens: int,
            digest: str = "", tokens: np.ndarray | None = None) -> str:
        """Takes over block_ids: the caller holds neither the array nor its references.
        Returns the lease's token."""
        token = secrets.token_urlsafe(16)
        with self._lock:
            old = self.leases.pop(ctx_request_id, None)
            if old is not None:   # a reused request id: the old lease ends, its blocks freed
                self._superseded.append((ctx_request_id, old.block_ids))
        if old is not None:
            for _, ended in self._watchers:
                ended(ctx_request_id)
        for started, _ in self._watchers:
            started(ctx_request_id, block_ids)
        with self._lock:
            self.leases[ctx_request_id] = Lease(block_ids, num_tokens,
                                                time.monotonic() + self.lease_seconds, token,
                                                digest, tokens)
        return token

    # -- transport threads ----------------------------------------------------------------
    def _find(self, ctx_request_id: str, lease_token: str, digest: str) -> Lease | None:
        """The live lease with this id and token (the caller holds the lock)."""
        lease = self.leases.get(ctx_request_id)
        if lease is None or not _same(lease.token, lease_token):
            return None
        if digest and lease.digest and not _same(lease.digest, digest):
            return None
        return lease

    def lookup(self, ctx_request_id: str, lease_token: str,
               digest: str = "") -> tuple[np.ndarray, int] | None:
        with self._lock:
            lease = self._find(ctx_request_id, lease_token, digest)
            if lease is None:
                return None
            lease.sending = True    # not expired under an in-flight send
            return lease.block_ids, lease.num_tokens

    def lookup_tokens(self, ctx_request_id: str, lease_token: str) -> np.ndarray | None:
        with self._lock:
            lease = self._find(ctx_request_id, lease_token, "")
            return None if lease is None else lease.tokens

    def release(self, ctx_request_id: str, lease_token: str) -> bool:
        with self._lock:
            lease = self._find(ctx_request_id, lease_token, "")
        if lease is None:
            return False
        # The Lease itself, not its id: collect frees exactly the lease this ack named.
        self.released.put((ctx_request_id, lease))
        self.wake()
        return True

    # -- engine thread --------------------------------------------------------------------
    def collect(self, now: float | None = None) -> list[np.ndarray]:
        """Block arrays whose lease ended (acked, expired and not mid-send, or superseded)."""
        now = time.monotonic() if now is None else now
        done = {}
        with self._lock:
            superseded, self._superseded = self._superseded, []
            while not self.released.empty():
                rid, lease = self.released.get()
                if self.leases.get(rid) is lease:
                    done[rid] = self.leases.pop(rid).block_ids
            for rid in [r for r, l in self.leases.items() if l.expires_at <= now and
                        (not l.sending or l.expires_at + self.lease_seconds <= now)]:
                done[rid] = self.leases.pop(rid).block_ids
        for rid in done:
            for _, ended in self._watchers:
                ended(rid)
        return [blocks for _, blocks in superseded] + list(done.values())

    @property
    def num_leased_blocks(self) -> int:
        with self._lock:
            return sum(len(l.block_ids) for l in self.leases.values())
