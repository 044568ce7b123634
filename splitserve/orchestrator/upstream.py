"""One try of one request on one worker, up to the moment something could reach the client.

A CTX answer is whole; a GEN answer is held until its first SSE event (or its whole body)
has arrived, so a try that fails before then is safe to run again elsewhere. What failed
is said with `Retry` (another server may serve it) or `TimedOut` (not retried: the worker
may still be working on it, and a second try would double its load).

Each try carries the worker's token (trust.py) and accepts only an answer carrying the
proof of the instance the token was made for: a process that took a dead worker's port
gets a token good for nothing else, and its answer never reaches the client. No redirect
is followed. An error is logged as its type and `str`: an aiohttp error's repr holds the
request's headers, the token among them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import aiohttp
import orjson

from splitserve.httpd.request_id import HEADER as REQUEST_ID_HEADER
from splitserve.orchestrator.cluster import Credentials
from splitserve.orchestrator.relay import SSE
from splitserve.protocol.internal_api import SENT_AT_HEADER
from splitserve.trust import INTERNAL_HEADER, PROOF_HEADER, proven

_EVENT_END = b"\n\n"
# A worker's whole answer, or one SSE event of its stream, held in memory: past this the
# worker is sending garbage (a legitimate answer is far smaller; the largest, prompt
# logprobs, are bounded at 2^20 entries, ~80 MB).
MAX_ANSWER_BYTES = 256 << 20


class Retry(Exception):
    """This try failed before anything reached the client. reason: a metric label;
    down: the server may not be the one verified (never connected, dropped the connection,
    refused the token, answered without the proof): stop routing to it until a health
    check verifies it again."""

    def __init__(self, reason: str, detail: str, down: bool = False):
        super().__init__(detail)
        self.reason, self.down = reason, down


class TimedOut(Exception):
    """The worker did not answer within first_byte_timeout."""


@dataclass
class Held:
    """A GEN response whose first event (or, unless it streams, whole body) is in hand and
    nothing of it sent to the client yet. The caller releases `response`."""
    response: aiohttp.ClientResponse
    head: bytes

    @property
    def streaming(self) -> bool:
        return self.response.content_type == SSE


@contextlib.contextmanager
def _failures():
    """aiohttp's errors as what the retry loop needs to know."""
    try:
        yield
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
        raise Retry("unreachable", f"could not connect: {exc}", down=True) from None
    except TimeoutError:   # asyncio.timeout's: the first byte took too long
        raise TimedOut() from None
    except (aiohttp.ClientError, ConnectionError) as exc:
        raise Retry("disconnected", f"connection lost before the answer: "
                                    f"{describe(exc)}", down=True) from None


def describe(exc: BaseException) -> str:
    """An error for a log line: its type and str, never its repr (see the module's doc)."""
    return f"{type(exc).__name__}: {exc}"


def creds_of(server) -> Credentials:
    """A cluster.Server's credentials; Retry if it was marked down since it was picked."""
    creds = server.creds
    if creds is None:
        raise Retry("unverified", "is not verified (its identity is being checked)", down=True)
    return creds


def _headers(creds: Credentials, rid: str) -> dict:
    # The receiver measures its preprocessing from the moment we wrote the request, and
    # logs it under the client request's id.
    return {"Content-Type": "application/json", SENT_AT_HEADER: repr(time.time()),
            INTERNAL_HEADER: creds.token, REQUEST_ID_HEADER: rid}


def is_proven(r: aiohttp.ClientResponse, creds: Credentials) -> bool:
    """The answer carries the proof of the instance creds were made for."""
    return proven(r.headers.get(PROOF_HEADER), creds.proof)


async def post_json(session: aiohttp.ClientSession, url: str, creds: Credentials, data: bytes,
                    first_byte_timeout: float, rid: str) -> tuple[int, dict]:
    """A whole JSON answer (CTX): (status, body). 5xx and unreadable answers are Retry.
    rid: the client request's X-Request-Id, which the worker logs it under."""
    with _failures():
        async with asyncio.timeout(first_byte_timeout):
            async with session.post(url, data=data, headers=_headers(creds, rid),
                                    allow_redirects=False) as r:
                status, ok = r.status, is_proven(r, creds)
                raw = await _whole(r) if ok else b""    # an unproven body is not read
    _check_status(status, raw, ok)
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise Retry("server_error", f"answered {status} with a body that is not JSON") from None
    if not isinstance(answer, dict):
        raise Retry("malformed", f"answered {status} with JSON that is not an object")
    return status, answer


async def open_generation(session: aiohttp.ClientSession, url: str, creds: Credentials,
                          data: bytes, first_byte_timeout: float, rid: str) -> Held:
    """Send to a GEN and hold its answer until the first event. 5xx, a stream whose first
    event is a server error, and a stream that ends before its first event are Retry."""
    r = None
    try:
        with _failures():
            async with asyncio.timeout(first_byte_timeout):
                r = await session.post(url, data=data, headers=_headers(creds, rid),
                                       allow_redirects=False)
                if not is_proven(r, creds):   # nothing of it is read
                    _check_status(r.status, b"", False)
                held = Held(r, b"")
                held.head = await (_first_event(r) if held.streaming else _whole(r))
        _check(held)
        return held
    except BaseException:
        if r is not None:
            r.close()    # the worker sees the connection go and aborts the request
        raise


async def read_at_most(r: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The response's body; None (and no more is read) if it is longer than limit."""
    if (r.content_length or 0) > limit:
        return None
    buf = bytearray()
    while chunk := await r.content.readany():
        buf += chunk
        if len(buf) > limit:
            return None
    return bytes(buf)


async def _whole(r: aiohttp.ClientResponse) -> bytes:
    """The answer's body, up to MAX_ANSWER_BYTES."""
    body = await read_at_most(r, MAX_ANSWER_BYTES)
    if body is None:
        raise Retry("malformed", f"answered more than {MAX_ANSWER_BYTES} bytes")
    return body


async def _first_event(r: aiohttp.ClientResponse) -> bytes:
    """Up to the first data event: comment lines before it (token ids) do not count. Each
    chunk is searched once (with the bytes an edge could split)."""
    buf, data = bytearray(), -1
    while True:
        chunk = await r.content.readany()
        if not chunk:
            raise Retry("disconnected", "the stream ended before its first event")
        start = len(buf)
        buf += chunk
        if data < 0:
            data = buf.find(b"data:", max(start - 4, 0))
        if data >= 0 and buf.find(_EVENT_END, max(start - 1, data)) >= 0:
            return bytes(buf)
        if len(buf) > MAX_ANSWER_BYTES:
            raise Retry("malformed", f"sent {MAX_ANSWER_BYTES} bytes without a whole first event")


def _check_status(status: int, raw: bytes, is_proven: bool) -> None:
    # The worker refused the orchestrator itself (it restarted: the token is its previous
    # instance's; or its internal secret is not this one's): the client did nothing wrong,
    # and the worker's words are about the cluster's insides.
    if status in (401, 403):
        raise Retry("refused", f"refused the orchestrator's internal token ({status}); it "
                               f"is checked again", down=True)
    if not is_proven:
        raise Retry("unproven", f"answered {status} without the proof of the instance it "
                                f"was verified as (another process on its port?)", down=True)
    if status >= 500:
        raise Retry("server_error", f"answered {status}: {raw[:200]!r}")


def _check(held: Held) -> None:
    _check_status(held.response.status, held.head, True)
    first = held.head[held.head.find(b"data:"):] if held.streaming else b""
    if first.startswith(b'data: {"error"'):
        try:
            error = orjson.loads(first[6:first.index(_EVENT_END)]).get("error") or {}
        except (orjson.JSONDecodeError, AttributeError):
            error = {}
        # A request the worker rejects would be rejected anywhere: it goes to the client.
        if error.get("type") != "invalid_request_error":
            raise Retry("error_event", f"first event is an error: {error.get('message')!r}")
