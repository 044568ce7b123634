"""GEN's answer to the client: its held first event, then its bytes as they arrive.

Once bytes have reached the client the request cannot be tried again; a stream that breaks,
stalls past idle_timeout or ends without `[DONE]` ends with an SSE error event and `[DONE]`,
so the client always learns that its response is incomplete.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import orjson

from splitserve.httpd import ChunkedStream, Request, Response
from splitserve.orchestrator.relay import SSE, as_stream
from splitserve.orchestrator.upstream import Held, describe
from splitserve.protocol.openai import DONE, sse_error

logger = logging.getLogger(__name__)

BROKE = "the generation worker stopped while streaming this response; it is incomplete"
ENDED = "the generation worker ended this response early; it is incomplete"
MALFORMED = "the generation worker sent a malformed stream; this response is incomplete"


class _Broken(Exception):
    """Reading GEN's stream failed (as opposed to writing to the client)."""


class _Malformed(Exception):
    """What GEN streamed cannot be read (its cause says why): token ids that are not
    numbers, an event past MAX_ANSWER_BYTES, a continuation's event that is not JSON."""


def _fed(feed, chunk: bytes) -> bytes:
    try:
        return feed(chunk)
    except (ValueError, TypeError, LookupError, AttributeError) as exc:
        raise _Malformed() from exc


class _IdleWatch:
    """Ends a read of GEN's stream that waits longer than `idle` seconds, through the
    enclosing asyncio.timeout. One timer per idle period, not one per chunk: a read only
    notes when it started waiting."""

    def __init__(self, deadline: asyncio.Timeout, idle: float):
        self.deadline, self.idle = deadline, idle
        self.loop = asyncio.get_running_loop()
        self.waiting_since: float | None = None
        self.timer = self.loop.call_at(self.loop.time() + idle, self._check)

    def _check(self) -> None:
        now = self.loop.time()
        since = self.waiting_since
        if since is not None and now - since >= self.idle:
            self.deadline.reschedule(now)
        else:
            self.timer = self.loop.call_at((since or now) + self.idle, self._check)

    async def read(self, content: aiohttp.StreamReader) -> bytes:
        self.waiting_since = self.loop.time()
        try:
            return await content.readany()
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise _Broken(describe(exc)) from None
        finally:
            self.waiting_since = None

    def close(self) -> None:
        self.timer.cancel()


async def forward(request: Request, held: Held, idle: float, tap=None,
                  carry_on=None) -> Response | ChunkedStream:
    """Copy GEN's status, content type and body to the client; GEN's connection stays the
    caller's to release. tap (migrate.StreamTap): strips and keeps the stream's token ids;
    carry_on(resp, problem): continues a stream that broke on another worker, returning the
    problem that is left (None: the stream was completed)."""
    upstream = held.response
    ctype = upstream.headers.get("Content-Type", "application/json")
    if not held.streaming:
        return Response(held.head, upstream.status, ctype)
    resp = request.stream({"Content-Type": ctype, "Cache-Control": "no-cache"}, upstream.status)
    problem = await relay(held, resp, idle, tap.feed if tap is not None else None,
                          lambda: tap is not None and tap.handoff is not None)
    if problem in (BROKE, ENDED) and carry_on is not None:
        problem = await carry_on(resp, problem)
    if problem is not None:
        await resp.write(sse_error(problem) + DONE)
    return resp    # the server ends its chunked body


async def relay(held: Held, resp: ChunkedStream, idle: float, feed=None,
                handed_off=lambda: False) -> str | None:
    """GEN's bytes (its held head first) to the client until GEN's end, each through
    feed(bytes) -> bytes if given; what went wrong, in the client's terms. A stream that
    ends without [DONE] after a draining worker's handoff (handed_off()) is ENDED too, but
    expected: its continuation is logged, not a warning."""
    try:
        last = _fed(feed, held.head) if feed is not None else held.head
        if last:
            await resp.write(last)
        async with asyncio.timeout(None) as deadline:
            watch = _IdleWatch(deadline, idle)
            try:
                while chunk := await watch.read(held.response.content):
                    if feed is not None and not (chunk := _fed(feed, chunk)):
                        continue
                    await resp.write(chunk)   # the client gone: raises, the handler ends
                    # [DONE] may be split across chunks: keep enough of the end to see it
                    last = chunk if len(chunk) >= len(DONE) else last[-len(DONE):] + chunk
            finally:
                watch.close()
    except TimeoutError:
        logger.warning("orch: generation stream idle for %.0f s; ending it", idle)
        return f"the generation worker sent nothing for {idle:g} s; this response is incomplete"
    except _Broken as exc:
        logger.warning("orch: generation stream broke: %s", exc)
        return BROKE
    except _Malformed as exc:
        logger.warning("orch: generation stream is malformed: %s", describe(exc.__cause__))
        return MALFORMED
    if not last.endswith(DONE):
        if not handed_off():
            logger.warning("orch: generation stream ended without [DONE]")
        return ENDED
    return None


def ctx_answer(body: dict, status: int, answer: dict) -> Response:
    """CTX finished the request (EOS, stop, max_tokens 1) or refused it: its answer stands,
    as SSE if the client streams."""
    answer.pop("disaggregated_params", None)
    if status == 200 and body.get("stream"):
        options = body.get("stream_options") or {}
        include = bool(options.get("include_usage"))
        continuous = include and bool(options.get("continuous_usage_stats"))
        return Response(as_stream(answer, include, continuous), content_type=SSE)
    return Response(orjson.dumps(answer), status)
