"""Routers: which server of a pool gets a request. Each is stateless across pools and
owns nothing but its own counters; the orchestrator keeps health and in-flight counts, and
orchestrator/kv_index.py what each worker caches."""

from __future__ import annotations

import abc
import functools
import hashlib
import itertools
from dataclasses import dataclass, field

from splitserve.orchestrator.cluster import Server


@dataclass
class RequestInfo:
    """What routers read of one request; built once per request (orchestrator/decide.py).
    key: the prompt's first bytes. session: the client's session id (bounded where it is
    read). hashes: block size -> chained hashes of the prompt's reusable full blocks, when
    the prompt was tokenized. index: the cluster's KVIndex, when one is kept. pin: the url
    that must serve the request while it is a candidate (a GEN that holds its prompt)."""
    key: bytes = b""
    session: str | None = None
    num_tokens: int | None = None
    hashes: dict[int, list[bytes]] = field(default_factory=dict)
    index: object = None
    pin: str | None = None

    def cached_tokens(self, server: Server) -> int:
        """Prompt tokens server holds in its prefix cache, as last reported."""
        return self.index.cached_tokens(server.url, self.hashes) if self.index else 0


class Router(abc.ABC):
    @abc.abstractmethod
    def pick(self, servers: list[Server], info: RequestInfo) -> Server:
        """servers: the healthy candidates, never empty."""


def route(router: Router, servers: list[Server], info: RequestInfo) -> Server:
    """router's pick, unless the request is pinned to one of the candidates."""
    if info.pin is not None:
        for s in servers:
            if s.url == info.pin:
                return s
    return router.pick(servers, info)


class RoundRobin(Router):
    def __init__(self):
        self._next = itertools.count()

    def pick(self, servers, info):
        return servers[next(self._next) % len(servers)]


class LeastLoaded(Router):
    """The lowest Server.load: the worker's reported load (so other orchestrators' requests
    count too), corrected by this orchestrator's own since the report; ties round robin."""

    def __init__(self):
        self._rr = RoundRobin()

    def pick(self, servers, info):
        low = min(s.load for s in servers)
        return self._rr.pick([s for s in servers if s.load == low], info)


def rendezvous(servers: list[Server], key: bytes) -> Server:
    """The server whose hash with key is highest: when one leaves, only its keys move."""
    return max(servers, key=lambda s: hashlib.blake2b(key + s.url.encode(), digest_size=8).digest())


class PrefixAware(Router):
    """Requests whose prompts start alike go to the same server, so its prefix cache hits."""

    def pick(self, servers, info):
        return rendezvous(servers, info.key)


class KVAware(Router):
    """The server that would prefill the fewest tokens, counting the ones it must wait
    for: cost = tokens it lacks of the prompt (its reported prefix cache) + load x prompt
    tokens (each request ahead of ours taken as one prompt like it). So a full hit wins
    over an idle server until the hit's holder is a whole request busier. Ties, and
    prompts not tokenized, go by prefix (PrefixAware), which seeds a cache for the next."""

    def pick(self, servers, info):
        n = info.num_tokens
        if not n or info.index is None:
            return rendezvous(servers, info.key)
        costs = {s.url: n - info.cached_tokens(s) + s.load * n for s in servers}
        low = min(costs.values())
        return rendezvous([s for s in servers if costs[s.url] == low], info.key)


class SessionAffinity(Router):
    """A session's requests go to one server while it is a candidate (healthy), chosen by
    rendezvous hashing, so a server that leaves moves only its own sessions. Requests
    without a session go to `inner`."""

    def __init__(self, inner: type[Router] = LeastLoaded):
        self.inner = inner()

    def pick(self, servers, info):
        if info.session is None:
            return self.inner.pick(servers, info)
        return rendezvous(servers, b"session\0" + info.session.encode("utf-8", "surrogatepass"))


_BASE = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "prefix_aware": PrefixAware,
         "kv_aware": KVAware}
# session_affinity (else least_loaded), or session_affinity+<router> for the rest.
ROUTERS = {**_BASE, "session_affinity": SessionAffinity,
           **{f"session_affinity+{n}": functools.partial(SessionAffinity, cls)
              for n, cls in _BASE.items()}}


def make_router(name: str) -> Router:
    return ROUTERS[name]()


def uses_kv_index(name: str) -> bool:
    return name.endswith("kv_aware")
