"""Which KV servers a GEN may pull from: the endpoint in a generation_only request comes from
a request body, so it is checked against what the worker was told, never dialed as given.

With `--kv-peers` (exact `tcp://host:port` entries: the cluster's CTX workers) only those;
without, only loopback endpoints (127.0.0.0/8, ::1, localhost), which is all a cluster on one
machine needs and keeps a forged handle from making the GEN dial into the network. Names are
compared as written, never resolved.
"""

from __future__ import annotations

import argparse
import ipaddress

from splitserve.kv.sockets import valid_endpoint


def _host(endpoint: str) -> str:
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


def is_loopback(endpoint: str) -> bool:
    host = _host(endpoint)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_peers(text: str) -> tuple[str, ...]:
    """`--kv-peers`: comma-separated endpoints (an argparse type)."""
    peers = tuple(e.strip() for e in text.split(",") if e.strip())
    bad = [p for p in peers if not valid_endpoint(p)]
    if bad:
        raise argparse.ArgumentTypeError(f"entries must be tcp://host:port, got {', '.join(bad)}")
    return peers


class KVPeers:
    def __init__(self, peers: tuple[str, ...]):
        bad = [p for p in peers if not valid_endpoint(p)]
        if bad:
            raise ValueError(f"KV peers must be tcp://host:port, got {', '.join(bad)}")
        self.peers = frozenset(peers)

    def allows(self, endpoint: str) -> bool:
        if self.peers:
            return endpoint in self.peers
        return valid_endpoint(endpoint) and is_loopback(endpoint)

    def describe(self) -> str:
        if self.peers:
            return ", ".join(sorted(self.peers))
        return "loopback endpoints only (127.0.0.0/8, ::1, localhost; set --kv-peers for others)"
