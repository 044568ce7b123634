"""Routers: which server of a pool gets a request. Each is stateless across pools and
owns nothing but its own counters; the orchestrator keeps health and in-flight counts."""

from __future__ import annotations

import abc
import hashlib
import itertools

from splitserve.orchestrator.cluster import Server


class Router(abc.ABC):
    @abc.abstractmethod
    def pick(self, servers: list[Server], key: bytes) -> Server:
        """servers: the healthy candidates, never empty. key: a prompt prefix (may be b"")."""


class RoundRobin(Router):
    def __init__(self):
        self._next = itertools.count()

    def pick(self, servers, key):
        return servers[next(self._next) % len(servers)]


class LeastLoaded(Router):
    """The lowest Server.load: the worker's reported load (so other orchestrators' requests
    count too), corrected by this orchestrator's own since the report; ties round robin."""

    def __init__(self):
        self._rr = RoundRobin()

    def pick(self, servers, key):
        low = min(s.load for s in servers)
        return self._rr.pick([s for s in servers if s.load == low], key)


class PrefixAware(Router):
    """Requests whose prompts start alike go to the same server, so its prefix cache hits.
    Rendezvous hashing: when a server leaves, only its share of prefixes moves."""

    def pick(self, servers, key):
        return max(servers, key=lambda s: hashlib.blake2b(key + s.url.encode(), digest_size=8).digest())


ROUTERS = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "prefix_aware": PrefixAware}


def make_router(name: str) -> Router:
    return ROUTERS[name]()
