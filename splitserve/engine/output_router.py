"""Which front-end each request came from, so that its outputs go back to that one only.

An engine serves one front-end, or several (`splitserve serve --api-server-count N`): the
process that owns the engine is peer 0, the front-ends are peers 1..N. Every front-end
gets the engine's stats; a request's deltas go to the front-end that submitted it. Owned by
the engine process's step loop (its main thread): no locks."""

from __future__ import annotations

from typing import Callable

from splitserve.protocol.engine import CompletionDelta, EngineOutputs, EngineStats


class OutputRouter:
    def __init__(self, num_peers: int):
        self.num_peers = num_peers
        self.owners: dict[str, int] = {}   # request id -> the peer that sent it

    def admit(self, request_id: str, peer: int) -> None:
        if peer:
            self.owners[request_id] = peer

    def gone(self, peer: int) -> list[str]:
        """The requests of a front-end that died (forgotten here: their deltas are dropped)."""
        ids = [rid for rid, p in self.owners.items() if p == peer]
        for rid in ids:
            del self.owners[rid]
        return ids

    def prune(self, unfinished: Callable[[str], bool]) -> None:
        """Forget requests the engine finished (called about twice a second)."""
        if self.owners:
            self.owners = {rid: p for rid, p in self.owners.items() if unfinished(rid)}

    def route(self, deltas: list[CompletionDelta], stats: EngineStats,
              news: bool) -> list[tuple[int, EngineOutputs]]:
        """(peer, message) pairs: each peer's deltas, and to every peer the stats when they
        are news (changed, or a heartbeat is due)."""
        by_peer: dict[int, list[CompletionDelta]] = {}
        for delta in deltas:
            peer = self.owners.get(delta.request_id, 0)
            by_peer.setdefault(peer, []).append(delta)
        peers = range(self.num_peers) if news else sorted(by_peer)
        return [(p, EngineOutputs(by_peer.get(p, []), stats)) for p in peers]
