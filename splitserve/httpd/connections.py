"""Who holds a server's connections, and who gives one up when a new one needs room.

A connection that has sent nothing, or nothing that shows a credential, costs its client a
TCP handshake and costs us a file descriptor for as long as we keep it. So, on arrival:
- a client address keeps at most `max_unproven_per_client` connections that have not yet
  shown a credential (the API key, or none when the server asks none); one more evicts its
  own oldest such connection;
- clients keep at most `max_public` connections; one more evicts the oldest unproven idle
  connection, else the longest-idle keep-alive one (closing an idle keep-alive connection
  is ordinary HTTP: clients reconnect);
- with nothing to evict, it is admitted on probation into the room left for the cluster's
  own traffic (heartbeats, registration, the orchestrator's requests to workers): its first
  request head must carry the internal secret, else it is answered 503;
- past `budget` (the file descriptors the server may hold) it is refused.
Internal connections are never evicted and do not count against `max_public`; a
connection that is answering a request is never evicted.

Every table here is insertion-ordered, so finding the oldest is O(1) and ten thousand idle
connections cost a dict entry each.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from enum import IntEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.httpd.protocol import HTTPConnection

logger = logging.getLogger(__name__)

SCAN = 16            # unproven connections looked at for one not answering a request


class Standing(IntEnum):
    """What a connection's requests have shown so far (the highest wins)."""
    UNPROVEN = 0     # nothing yet, or only requests the server answers anyone (/health)
    CLIENT = 1       # the API key (or the server asks none)
    INTERNAL = 2     # the cluster's internal secret


class Connections:
    def __init__(self, max_public: int, budget: int, max_unproven_per_client: int):
        self.max_public, self.budget = max_public, budget
        self.per_client = max_unproven_per_client
        self.all: set[HTTPConnection] = set()
        self.internal = 0
        self.unproven: OrderedDict[HTTPConnection, None] = OrderedDict()    # by arrival
        self.by_peer: dict[str, OrderedDict[HTTPConnection, None]] = {}     # unproven ones
        self.idle: OrderedDict[HTTPConnection, None] = OrderedDict()  # CLIENT, by idle time
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.all)

    def __iter__(self):
        return iter(list(self.all))

    @property
    def public(self) -> int:
        return len(self.all) - self.internal

    def admit(self, conn: HTTPConnection) -> bool:
        """Make room for a new connection (evicting others); False: refuse it."""
        peer = self.by_peer.get(conn.peer)
        if peer is not None and len(peer) >= self.per_client:
            self._evict_first(peer)
        if self.public >= self.max_public or len(self.all) >= self.budget:
            if not (self._evict_first(self.unproven) or self._evict_first(self.idle)):
                if len(self.all) >= self.budget:
                    return False
                conn.probation = True
        self.all.add(conn)
        self.unproven[conn] = None
        self.by_peer.setdefault(conn.peer, OrderedDict())[conn] = None
        return True

    def over_public(self) -> bool:
        """Clients hold more than max_public (on probation: only internal traffic may stay)."""
        return self.public > self.max_public

    def shown(self, conn: HTTPConnection, standing: Standing) -> None:
        """conn's request head showed `standing`."""
        if standing <= conn.standing:
            return
        if conn.standing == Standing.UNPROVEN:
            self._forget_unproven(conn)
        if standing == Standing.INTERNAL:
            self.internal += 1
            self.idle.pop(conn, None)
        conn.standing = standing

    def went_idle(self, conn: HTTPConnection) -> None:
        if conn.standing == Standing.CLIENT:
            self.idle[conn] = None       # (re-inserted: the end is the latest)
            self.idle.move_to_end(conn)

    def went_busy(self, conn: HTTPConnection) -> None:
        self.idle.pop(conn, None)

    def remove(self, conn: HTTPConnection) -> None:
        if conn not in self.all:
            return
        self.all.discard(conn)
        self.idle.pop(conn, None)
        if conn.standing == Standing.UNPROVEN:
            self._forget_unproven(conn)
        elif conn.standing == Standing.INTERNAL:
            self.internal -= 1

    def _forget_unproven(self, conn: HTTPConnection) -> None:
        self.unproven.pop(conn, None)
        peer = self.by_peer.get(conn.peer)
        if peer is not None:
            peer.pop(conn, None)
            if not peer:
                del self.by_peer[conn.peer]

    def _evict_first(self, table: OrderedDict[HTTPConnection, None]) -> bool:
        """Close the oldest connection of table that is not answering a request and has no
        bytes waiting to be read (a burst of accepts runs before any of them is read: a
        client's request may be in, unread, behind the connections that sent nothing)."""
        for i, conn in enumerate(table):
            if i >= SCAN:
                return False
            if conn.task is None and not conn.queue and not conn.input_waiting():
                self.remove(conn)
                self.evicted += 1
                conn.transport.close()
                return True
        return False
