"""Cluster membership in etcd: the agreement between a worker that keeps itself in the
cluster (server/etcd_registration.py) and every orchestrator that watches it
(orchestrator/etcd_membership.py).

The setting is one URL, `etcd://host:port/prefix` (`--membership` on `serve` and
`orchestrator`, `membership:` in the cluster file), optionally `?ttl=SECONDS`: how long a
worker's lease lasts without a keep-alive (a worker's setting; default LEASE_TTL).

Each worker holds one etcd lease and one key under the prefix, `<prefix>/workers/<url>`,
attached to that lease. Its value is a SignedMember: the worker's record (role, url, KV
endpoint, model, KV layout fingerprint) and a MAC of the record and its key under the
cluster's internal secret (trust.Keys.member_mac). A reader takes a record only if its MAC
checks out and its key is the one its url names: anyone who can write to etcd but does not
hold the secret cannot add a worker, nor move a record to another key. The key lapses with
the lease, so a worker whose process died leaves within its TTL.
"""

from __future__ import annotations

from typing import NamedTuple
from urllib.parse import parse_qs, urlsplit

import msgspec

SCHEME = "etcd"
LEASE_TTL = 10.0                  # seconds a worker's lease lasts without a keep-alive
TTL_RANGE = (1.0, 3600.0)
MAX_VALUE_BYTES = 16 << 10        # a record past this is not a member's
WORKERS = "/workers/"


class EtcdTarget(NamedTuple):
    """Where the members are: etcd's HTTP endpoint, the key prefix, a worker's lease TTL."""
    endpoint: str                 # http://host:port (etcd's v3 JSON gateway)
    prefix: str                   # no trailing "/"
    ttl: float

    @property
    def workers(self) -> str:
        """The prefix every member's key starts with."""
        return self.prefix + WORKERS

    def key(self, url: str) -> str:
        return self.workers + url


def parse_target(value: str) -> EtcdTarget:
    """`etcd://host:port/prefix[?ttl=s]` -> EtcdTarget; ValueError naming what is wrong."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        raise ValueError(f"membership must be etcd://host:port/prefix, got {value[:200]!r}") \
            from None
    if parts.scheme != SCHEME or not parts.hostname or port is None:
        raise ValueError(f"membership must be etcd://host:port/prefix, got {value[:200]!r}")
    prefix = parts.path.rstrip("/")
    if not prefix or parts.fragment:
        raise ValueError(f"membership needs a key prefix (etcd://host:port/prefix), got "
                         f"{value[:200]!r}")
    query = parse_qs(parts.query, strict_parsing=bool(parts.query))
    if set(query) - {"ttl"}:
        raise ValueError(f"membership takes only ?ttl=SECONDS, got {parts.query[:100]!r}")
    try:
        ttl = float(query.get("ttl", [LEASE_TTL])[-1])
    except ValueError:
        ttl = -1.0
    if not TTL_RANGE[0] <= ttl <= TTL_RANGE[1]:
        raise ValueError(f"membership's ttl must be {TTL_RANGE[0]:g} to {TTL_RANGE[1]:g} "
                         f"seconds, got {query['ttl'][-1]!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return EtcdTarget(f"http://{host}:{port}", prefix, ttl)


class MemberRecord(msgspec.Struct, forbid_unknown_fields=True):
    role: str                     # roles.REGISTERED_ROLES
    url: str                      # the worker's base url
    kv_endpoint: str = ""         # its engine's KV server ("" where it serves none)
    model: str = ""
    layout: str = ""              # kv.base.layout_fingerprint() of its engine

    def signed_bytes(self, key: str) -> bytes:
        """What the MAC covers: the key and the record, canonical (msgspec encodes the
        fields in their declared order)."""
        return key.encode() + b"\n" + msgspec.json.encode(self)


class SignedMember(msgspec.Struct, forbid_unknown_fields=True):
    record: MemberRecord
    mac: str


def sign(record: MemberRecord, key: str, keys) -> bytes:
    """The value a worker puts at `key` (keys: trust.Keys of the cluster's secret)."""
    return msgspec.json.encode(SignedMember(record, keys.member_mac(record.signed_bytes(key))))


def read(key: str, value: bytes, keys) -> MemberRecord | None:
    """The record `value` holds if its MAC under `keys` checks out for `key`; None for
    anything else (not a SignedMember, another secret's, moved from another key)."""
    if len(value) > MAX_VALUE_BYTES:
        return None
    try:
        signed = msgspec.json.decode(value, type=SignedMember)
    except msgspec.DecodeError:      # ValidationError is one
        return None
    record = signed.record
    if not keys.member_mac_ok(record.signed_bytes(key), signed.mac):
        return None
    return record
