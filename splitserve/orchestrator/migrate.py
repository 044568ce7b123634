"""Mid-stream migration: a generation worker that dies while streaming is replaced by another,
which continues the response after the tokens the client already has.

The orchestrator asks GEN to tag each SSE event with its token ids (`stream_token_ids`: a
comment line `: ids 1 2 3` before the event; protocol/disagg.py writes and reads it).
`StreamTap` strips those comments from what reaches the client and keeps the ids. When the
stream breaks, `resume_body` is the client's original request plus `resume_token_ids`: a
worker recomputes prompt + those tokens (as after a preemption) and samples on from there, so
greedy output equals an uninterrupted run.
`Continuation` makes the new worker's events look like the rest of the first stream: same
response id and created time, no second role chunk, usage counting every token.

A draining worker (server/drain.py) ends such a stream with a handoff comment instead of
[DONE]: the generation_only parameters of the stream's KV, leased there. `moved_body` then
continues it as a generation_only request with those and `resume_token_ids`: the new worker
pulls the KV (the prompt's and the tokens so far but the last) and decodes on, recomputing
nothing; should that fail before its first event, the stream is recomputed as above.

Only the continuation's events are decoded as JSON; the first stream costs a byte search per
chunk (migration is rare, streaming is not).
"""

from __future__ import annotations

import logging

import orjson

from splitserve.orchestrator import stream, upstream
from splitserve.protocol.disagg import HANDOFF_COMMENT, IDS_COMMENT, comment_ids

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]"


class StreamTap:
    """Everything one response streamed so far, as far as migration needs to know."""

    __slots__ = ("token_ids", "finished", "done", "first_event", "handoff", "_rest")

    def __init__(self):
        self.token_ids: list[int] = []
        self.finished = False          # an event carried a finish_reason
        self.done = False              # [DONE] went out
        self.first_event: bytes | None = None   # its id and created time, decoded if needed
        self.handoff: dict | None = None   # a draining worker's: where the stream's KV is
        self._rest = bytearray()       # an unfinished event, held until its end arrives

    def feed(self, chunk: bytes) -> bytes:
        """GEN's bytes -> the bytes to send the client: whole events, ids comments removed.
        ValueError: token ids that are not numbers, an event past MAX_ANSWER_BYTES."""
        if self._rest:     # each byte is searched once, wherever the event's end falls
            start = len(self._rest) - 1
            self._rest += chunk
            end = self._rest.rfind(b"\n\n", start)
            whole = bytes(self._rest[:end + 2]) if end >= 0 else b""
        else:
            end = chunk.rfind(b"\n\n")
            if end >= 0 and end + 2 == len(chunk):
                return self._whole(chunk)
            self._rest += chunk
            whole = chunk[:end + 2] if end >= 0 else b""
        if end < 0:
            if len(self._rest) > upstream.MAX_ANSWER_BYTES:
                raise ValueError(f"an event longer than {upstream.MAX_ANSWER_BYTES} bytes")
            return b""
        del self._rest[:end + 2]
        return self._whole(whole)

    def _whole(self, whole: bytes) -> bytes:
        if IDS_COMMENT not in whole and HANDOFF_COMMENT not in whole \
                and self.first_event is not None:
            self._note(whole)
            return whole
        kept = [e for e in whole[:-2].split(b"\n\n") if self._keep(e)]
        return b"".join(e + b"\n\n" for e in kept)

    def _keep(self, event: bytes) -> bool:
        if event.startswith(IDS_COMMENT):
            self.token_ids += comment_ids(event)
            return False
        if event.startswith(HANDOFF_COMMENT):
            self.handoff = orjson.loads(event[len(HANDOFF_COMMENT):])
            if not isinstance(self.handoff, dict):
                raise ValueError("a handoff that is not an object")
            return False
        if self.first_event is None and event.startswith(b"data: {"):
            self.first_event = event
        self._note(event)
        return True

    def _note(self, events: bytes) -> None:
        if b'"finish_reason":"' in events:
            self.finished = True
        if DONE in events:
            self.done = True

    def migratable(self, max_tokens: int | None) -> bool:
        """Worth continuing elsewhere: it started, nothing finished, tokens remain."""
        return (self.first_event is not None and not self.finished and not self.done
                and (max_tokens is None or len(self.token_ids) < max_tokens))


def resume_body(body: dict, token_ids: list[int]) -> dict:
    """The client's request (prompt or messages included) continued after token_ids, as an
    aggregated request: the worker prefills prompt + token_ids itself."""
    out = {k: v for k, v in body.items() if k != "token_relay"}
    out["stream"] = True
    out["disaggregated_params"] = {"resume_token_ids": token_ids, "stream_token_ids": True}
    return out


def moved_body(body: dict, token_ids: list[int], handoff: dict) -> dict:
    """The client's request continued after token_ids on a worker that pulls the stream's
    KV from the draining one (handoff: its generation_only disaggregated_params); the
    prompt travels as its length only (a stream whose prompt values are read is not
    handed off)."""
    out = {k: v for k, v in body.items() if k not in ("prompt", "messages", "token_relay")}
    out["stream"] = True
    out["disaggregated_params"] = {**handoff, "request_type": "generation_only",
                                   "resume_token_ids": token_ids, "stream_token_ids": True}
    return out


def max_tokens(body: dict) -> int | None:
    value = body.get("max_completion_tokens")
    if value is None:
        value = body.get("max_tokens", None if "messages" in body else 16)
    return value if isinstance(value, int) else None


class Continuation:
    """Rewrites a resumed worker's events into the first stream's: its id and created time,
    the chat role chunk dropped (the client has it), usage counting the tokens sent before."""

    def __init__(self, tap: StreamTap):
        first = orjson.loads(tap.first_event[len(b"data: "):])
        self.id, self.created = first.get("id"), first.get("created")
        self.tap = tap
        self.earlier = len(tap.token_ids)
        self.inner = StreamTap()

    def feed(self, chunk: bytes) -> bytes:
        out = []
        events = self.inner.feed(chunk)
        self.tap.token_ids[self.earlier:] = self.inner.token_ids
        self.tap.finished, self.tap.done = self.inner.finished, self.inner.done
        self.tap.handoff = self.inner.handoff    # the continuing worker drains too
        for event in events[:-2].split(b"\n\n") if events else ():
            out.append(self._rewrite(event))
        return b"".join(e + b"\n\n" for e in out if e)

    def _rewrite(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {"):
            return event
        obj = orjson.loads(event[len(b"data: "):])
        if "error" in obj:
            return event
        obj["id"], obj["created"] = self.id, self.created
        choices = obj.get("choices") or []
        if choices and choices[0].get("delta") == {"role": "assistant", "content": ""}:
            return b""
        usage = obj.get("usage")
        if usage:
            usage["completion_tokens"] = usage.get("completion_tokens", 0) + self.earlier
            usage["total_tokens"] = usage.get("total_tokens", 0) + self.earlier
        return b"data: " + orjson.dumps(obj)


async def carry_on(pools, request, resp, tap: StreamTap, body: dict, info,
                   avoid: list, problem: str) -> str | None:
    """Continue the stream of the client's `request` (its path and X-Request-Id) that broke,
    on other generation workers of `pools` (pools.Pools),
    avoiding those in `avoid`, the broken one first; the problem left (None: the stream was
    completed). Unlike the request's retry loop (pools.py), a failure here is not a retry of
    the request: the client has bytes already, so each worker is tried once, and the
    outcome counts in migrations_total."""
    limit, config = max_tokens(body), pools.config
    for _ in range(max(config.max_retries, 1)):
        server = pools.gen.pick(info, avoid)
        if not tap.migratable(limit) or server is None or server in avoid:
            break
        avoid.append(server)
        moved = tap.handoff is not None
        (logger.info if moved else logger.warning)(
            "orch: request %s: generation stream %s after %d tokens; continuing it on %s",
            request.id, "handed off" if moved else "broke", len(tap.token_ids), server.url)
        data = orjson.dumps(moved_body(body, tap.token_ids, tap.handoff) if moved
                            else resume_body(body, tap.token_ids))
        server.in_flight += 1
        try:
            held = await upstream.open_generation(pools.session, server.url + request.path,
                                                  upstream.creds_of(server), data,
                                                  config.first_byte_timeout, request.id)
        except (upstream.Retry, upstream.TimedOut) as exc:
            logger.warning("orch: request %s: %s could not continue the stream: %s",
                           request.id, server.url, exc)
            if isinstance(exc, upstream.Retry) and exc.down:
                pools.gen.mark_down(server.url)
            server.in_flight -= 1
            tap.handoff = None    # its KV may be gone: the next try recomputes the stream
            continue
        pools.metrics.handoffs.labels("kv" if moved else "recompute").inc()
        tap.handoff = None
        try:
            try:
                feed = Continuation(tap).feed
            except (ValueError, AttributeError):    # the first stream's first event
                return stream.MALFORMED
            problem = await stream.relay(held, resp, config.idle_timeout, feed,
                                         lambda: tap.handoff is not None)
        finally:
            held.response.close()
            server.in_flight -= 1
        pools.metrics.migrations.labels("completed" if problem is None else "broke").inc()
        if problem not in (stream.BROKE, stream.ENDED):
            return problem
    pools.metrics.migrations.labels("gave_up").inc()
    return problem
