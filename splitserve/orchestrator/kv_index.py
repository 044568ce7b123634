"""Which prefix blocks each worker holds, as its GET /internal/kv_blocks last said
(server/kv_blocks.py): what the KV-aware router and the local-prefill decision read.

Polled, not pushed: a worker that goes away just stops being read (its entry is dropped
with it), and a stale answer costs a cache miss, never a wrong output (the index only
chooses where a request goes; the worker finds its own prefix hits)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
import orjson

from splitserve.orchestrator.cluster import Credentials
from splitserve.orchestrator.upstream import is_proven
from splitserve.protocol.internal_api import KV_BLOCKS_PATH, read_kv_blocks
from splitserve.trust import INTERNAL_HEADER

# A worker reports at most 16,384 hashes (engine/kv_report.py): ~350 KB of JSON. More is
# not a worker of this cluster's: it is ignored.
MAX_BODY_BYTES = 1 << 20
_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


@dataclass(frozen=True)
class Held:
    version: str
    block_size: int
    hashes: frozenset[bytes]


class KVIndex:
    def __init__(self):
        self.held: dict[str, Held] = {}

    def block_sizes(self) -> set[int]:
        return {h.block_size for h in self.held.values() if h.block_size}

    def cached_tokens(self, url: str, hashes: dict[int, list[bytes]]) -> int:
        """How many leading tokens of a prompt (its chained hashes per block size) url holds."""
        held = self.held.get(url)
        chain = hashes.get(held.block_size) if held else None
        if not chain:
            return 0
        n = 0
        for h in chain:
            if h not in held.hashes:
                break
            n += 1
        return n * held.block_size

    async def poll(self, session: aiohttp.ClientSession,
                   servers: dict[str, Credentials]) -> set[str]:
        """Read the report of every server (url: its credentials), concurrently, with its
        token and only if proven; forget urls no longer listed (returned)."""
        gone = set(self.held) - set(servers)
        for url in gone:
            del self.held[url]
        await asyncio.gather(*(self._read(session, url, c) for url, c in servers.items()))
        return gone

    async def _read(self, session: aiohttp.ClientSession, url: str, creds: Credentials) -> None:
        known = self.held.get(url)
        params = {"since": known.version} if known else None
        try:
            async with session.get(url + KV_BLOCKS_PATH, params=params, timeout=_TIMEOUT,
                                   headers={INTERNAL_HEADER: creds.token},
                                   allow_redirects=False) as r:
                # (the worker always sends a Content-Length)
                if r.status != 200 or not is_proven(r, creds) \
                        or not 0 < (r.content_length or 0) <= MAX_BODY_BYTES:
                    return
                body = orjson.loads(await r.read())
        except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError):
            return
        held = parse_report(body)
        if held is not None:
            self.held[url] = held


def parse_report(body) -> Held | None:
    """A Held from a /internal/kv_blocks body; None for `unchanged` or anything malformed."""
    read = read_kv_blocks(body)
    return None if read is None else Held(read[0], read[1], frozenset(read[2]))
