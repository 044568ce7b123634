"""A small asyncio client for etcd's v3 API through its JSON gateway (the HTTP endpoint
every etcd server serves beside gRPC: /v3/kv/*, /v3/lease/*, /v3/watch), on the aiohttp
client splitserve already uses. Keys and values cross as base64; 64-bit numbers as JSON
strings. docs/deploy.md says why this and not a gRPC client.

Only what cluster membership needs (protocol/membership.py): leases (grant, keep-alive,
revoke), put, a prefix's range, and a prefix's watch. Every call raises EtcdUnavailable
when etcd does not answer or answers with an error, so a caller has one failure to handle.
"""

from __future__ import annotations

import asyncio
import base64
from typing import AsyncIterator, NamedTuple

import aiohttp
import orjson

CALL_TIMEOUT = aiohttp.ClientTimeout(total=5.0)


class EtcdUnavailable(OSError):
    """etcd did not answer, or answered with an error."""


class Event(NamedTuple):
    """A key's change: value None when it was deleted (or its lease lapsed)."""
    key: str
    value: bytes | None


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode("ascii")


def prefix_end(prefix: str) -> str:
    """The range_end that makes a range or watch cover every key starting with prefix."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    raw[-1] += 1
    return _b64(bytes(raw))


def _event(kv: dict, deleted: bool) -> Event:
    key = base64.b64decode(kv.get("key", ""), validate=True).decode("utf-8", "replace")
    return Event(key, None if deleted else base64.b64decode(kv.get("value", ""), validate=True))


class EtcdClient:
    """Calls etcd at `endpoint` (http://host:port) with `session` (the caller's: it is
    neither made nor closed here)."""

    def __init__(self, session: aiohttp.ClientSession, endpoint: str):
        self.session, self.endpoint = session, endpoint.rstrip("/")

    async def _call(self, path: str, body: dict) -> dict:
        try:
            async with self.session.post(self.endpoint + path, data=orjson.dumps(body),
                                         timeout=CALL_TIMEOUT, allow_redirects=False) as r:
                answer = await r.read()
                if r.status != 200:
                    raise EtcdUnavailable(f"etcd answered {r.status} to {path}: "
                                          f"{answer[:200].decode('utf-8', 'replace')}")
                answer = orjson.loads(answer)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # (bad JSON)
            raise EtcdUnavailable(f"etcd at {self.endpoint} did not answer {path}: "
                                  f"{exc or type(exc).__name__}") from None
        if not isinstance(answer, dict):
            raise EtcdUnavailable(f"etcd answered {path} with something other than an object")
        return answer

    async def grant(self, ttl: float) -> str:
        """A new lease of `ttl` seconds (whole seconds, at least 1): its id."""
        answer = await self._call("/v3/lease/grant", {"TTL": max(1, round(ttl))})
        return str(answer["ID"])

    async def keepalive(self, lease: str) -> bool:
        """Renew the lease; False if etcd no longer has it (it lapsed)."""
        answer = await self._call("/v3/lease/keepalive", {"ID": lease})
        return int(answer.get("result", {}).get("TTL", 0)) > 0

    async def revoke(self, lease: str) -> None:
        """End the lease now: the keys attached to it are deleted."""
        await self._call("/v3/lease/revoke", {"ID": lease})

    async def ping(self) -> None:
        """Raises EtcdUnavailable unless etcd answers."""
        await self._call("/v3/maintenance/status", {})

    async def put(self, key: str, value: bytes, lease: str | None = None) -> None:
        body = {"key": _b64(key), "value": _b64(value)}
        if lease is not None:
            body["lease"] = lease
        await self._call("/v3/kv/put", body)

    async def get(self, key: str) -> bytes | None:
        """The value at key; None where there is none."""
        kvs = (await self._call("/v3/kv/range", {"key": _b64(key)})).get("kvs", [])
        return _event(kvs[0], False).value if kvs else None

    async def range(self, prefix: str) -> tuple[int, list[Event]]:
        """(the store's revision, every key under prefix with its value)."""
        answer = await self._call("/v3/kv/range", {"key": _b64(prefix),
                                                   "range_end": prefix_end(prefix)})
        revision = int(answer["header"]["revision"])
        return revision, [_event(kv, False) for kv in answer.get("kvs", [])]

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[list[Event]]:
        """The changes under prefix from start_revision on, a batch per etcd message, as
        they happen; EtcdUnavailable when the watch ends (etcd went, or compacted the
        revision asked for: read the range again)."""
        body = {"create_request": {"key": _b64(prefix), "range_end": prefix_end(prefix),
                                   "start_revision": start_revision}}
        try:
            async with self.session.post(
                    self.endpoint + "/v3/watch", data=orjson.dumps(body), allow_redirects=False,
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0)) as r:
                if r.status != 200:
                    raise EtcdUnavailable(f"etcd answered {r.status} to /v3/watch")
                async for line in r.content:
                    yield _watch_events(line)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            # ValueError: a message past aiohttp's line limit (read the range instead)
            raise EtcdUnavailable(f"the watch on etcd at {self.endpoint} broke: "
                                  f"{exc or type(exc).__name__}") from None
        raise EtcdUnavailable(f"etcd at {self.endpoint} ended the watch")


def _watch_events(line: bytes) -> list[Event]:
    """One watch message's events (none for the creation and progress messages)."""
    try:
        result = orjson.loads(line).get("result") or {}
        if result.get("canceled") or result.get("compact_revision"):
            reason = result.get("cancel_reason") or "compacted"
            raise EtcdUnavailable(f"etcd canceled the watch: {reason}")
        return [_event(e.get("kv", {}), e.get("type") == "DELETE")
                for e in result.get("events", [])]
    except (AttributeError, TypeError, ValueError):   # (bad JSON, bad base64: ValueErrors)
        raise EtcdUnavailable("etcd sent a watch message of another shape") from None
