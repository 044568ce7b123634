"""Resumable streams: every SSE event the orchestrator sends carries an `id:`, and a client
that lost the stream sends the same request again with `Last-Event-ID` to get the rest.

An id is `<n>.<started>.<signature>`: n counts the stream's events (1, 2, ...; an error
event and `[DONE]` repeat the id before them, so they never shift the count), started is
the unix second the stream began, and the signature binds both to the request's
X-Request-Id, its API key and its body, under a key derived from the internal secret.
Nothing is kept per stream: any process of a fleet, or one restarted, checks an id alone.

A resumed request is served again from the start and its first n events are not sent:
exact wherever the events are a pure function of the request, that is a single choice
that is greedy (temperature 0) or seeded (engine/seeded.py). Any other request is refused
resumption (409) rather than sent a different sample's rest.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time

import orjson

from splitserve.httpd import ChunkedStream, Response
from splitserve.orchestrator.upstream import MAX_ANSWER_BYTES
from splitserve.protocol.openai import error_body

LAST_EVENT_ID = "Last-Event-ID"
_ID = re.compile(rb"([0-9]{1,9})\.([0-9]{1,12})\.([A-Za-z0-9_-]{22})")
_DATA = b"data: "
# a chunk's head: its response id (prefix kept), object (as_stream: after created), created
_HEAD = re.compile(rb'data: \{"id":"([a-z]+-)?([^"]*)",(?:"object":"[^"]*",)?"created":([0-9]+)')
_UNCOUNTED = (b'data: {"error"', b"data: [DONE]")   # keep the id of the event before them
_SIG_BYTES = 8      # per signature; an id carries two (who asked, and for what)


class Refused(Exception):
    """A resumption that cannot be served: its HTTP status, message and the field named."""

    def __init__(self, status: int, message: str, param: str = LAST_EVENT_ID):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def digest(path: str, body: dict) -> bytes:
    """What a resumed request must repeat: its route and its body's fields and values (key
    order and white space aside)."""
    return hashlib.sha256(path.encode() + b"\0" + orjson.dumps(
        body, option=orjson.OPT_SORT_KEYS)).digest()


def not_reproducible(body: dict, split: bool) -> str | None:
    """Why serving `body` again may give other events (None: it gives the same).
    split: it is served as several parts (split.py), whose events merge as they come."""
    if split:
        return ("a request of several choices or prompts merges its events in the order "
                "they come, which a second run does not repeat")
    temperature = body.get("temperature")
    if body.get("seed") is None and (temperature is None or temperature != 0):
        return ("it samples without a seed, so a second run gives another answer; send "
                "`seed` (or temperature 0) to make a stream resumable")
    return None


class StreamIds:
    """Signs a stream's ids and checks the one a resuming client sends. window: how many
    seconds after a stream started it may be resumed (0: never)."""

    def __init__(self, internal_secret: str, window: float):
        self.key = hmac.new(internal_secret.encode(), b"splitserve stream ids",
                            hashlib.sha256).digest()
        self.window = window

    def stamp(self, rid: str, tenant: str | None, body_digest: bytes,
              started: int | None = None) -> bytes:
        """What follows `<n>.` in each id of this stream."""
        started = int(time.time()) if started is None else started
        who, what = self._signatures(rid, tenant, body_digest, started)
        return b"%d.%s" % (started, base64.urlsafe_b64encode(who + what).rstrip(b"="))

    def check(self, last_id: str, rid: str, tenant: str | None, body_digest: bytes,
              now: float | None = None) -> tuple[int, int]:
        """(the events the client has, when its stream started) from its Last-Event-ID;
        Refused if it names no stream this request id and key were sent, another body's,
        or one past the window."""
        if not self.window:
            raise Refused(400, "this server does not resume streams (resume_window is 0)")
        m = _ID.fullmatch(last_id.strip().encode("latin-1", "replace"))
        if m is None:
            raise Refused(400, f"{LAST_EVENT_ID} is not an event id this server sends "
                               "(<n>.<started>.<signature>)")
        n, started = int(m[1]), int(m[2])
        sig = base64.urlsafe_b64decode(m[3] + b"==")
        who, what = self._signatures(rid, tenant, body_digest, started)
        if not hmac.compare_digest(sig[:_SIG_BYTES], who):
            raise Refused(404, f"no stream with this {LAST_EVENT_ID} was sent for this "
                               "X-Request-Id and API key")
        if not hmac.compare_digest(sig[_SIG_BYTES:], what):
            raise Refused(409, "the body differs from the one of the stream being resumed; "
                               "resend it unchanged", "body")
        age = (time.time() if now is None else now) - started
        if age > self.window:
            raise Refused(410, f"the stream started {age:.0f} s ago; streams resume within "
                               f"{self.window:g} s of their start (resume_window)")
        return n, started

    def _signatures(self, rid: str, tenant: str | None, body_digest: bytes,
                    started: int) -> tuple[bytes, bytes]:
        who = hmac.new(self.key, b"\0".join((rid.encode(), (tenant or "").encode(),
                                             b"%d" % started)), hashlib.sha256).digest()
        what = hmac.new(self.key, who + body_digest, hashlib.sha256).digest()
        return who[:_SIG_BYTES], what[:_SIG_BYTES]


class Numbering:
    """Gives each whole SSE event its id and drops the first `skip` counted ones. The
    response id and created time in each chunk become the stream's own (from its stamp),
    so a second run's chunks are the first run's: every chunk of a response starts with
    the same head, replaced by a byte comparison (no JSON)."""

    __slots__ = ("stamp", "skip", "count", "_head", "_ours")

    def __init__(self, stamp: bytes, skip: int = 0):
        self.stamp = b"." + stamp + b"\n"     # what follows n in each id line
        self.skip, self.count = skip, 0
        self._head: bytes | None = None     # the workers' chunk head, once seen
        self._ours = b""                    # ... and the stream's own in its place

    def events(self, whole: bytes) -> bytes:
        """whole: complete events (each ending in a blank line) -> the ones to send, with ids."""
        if whole.find(b"\n\n") == len(whole) - 2:      # one event: most writes
            return self._one(whole[:-2])
        return b"".join(self._one(e) for e in whole[:-2].split(b"\n\n"))

    def _one(self, event: bytes) -> bytes:
        data = event.startswith(_DATA)
        counted = data and not event.startswith(_UNCOUNTED)
        self.count += counted
        if self.count < self.skip or (counted and self.count == self.skip):
            return b""                          # the client has it
        if not data:                            # a comment, not an event: as it came
            return event + b"\n\n"
        if self._head is None:
            self._learn(event)
        if self._head is not None and event.startswith(self._head):
            event = self._ours + event[len(self._head):]
        return b"id: " + str(self.count).encode() + self.stamp + event + b"\n\n"

    def _learn(self, event: bytes) -> None:
        """The head of the workers' chunks, if `event` is one, and the stream's own: a
        response id named from the stamp's signature, created at its start."""
        m = _HEAD.match(event)
        if m is not None:
            started, sig = self.stamp[1:-1].split(b".", 1)
            name = hashlib.sha256(sig).hexdigest()[:32].encode()
            self._head = m[0]
            self._ours = (m[0][:m.start(2)] + name + m[0][m.end(2):m.start(3)] + started
                          + m[0][m.end(3):])

    @property
    def past_end(self) -> bool:
        return self.count < self.skip


class EventStream:
    """What a streamed request writes to instead of its ChunkedStream: whole events get
    their ids. A resumed stream opens the client's stream at the first byte it is to
    receive, so one whose skipped events are all there is answers 416 instead."""

    def __init__(self, request, numbering: Numbering, headers: dict, status: int):
        self.request, self.numbering = request, numbering
        self.headers, self.status = headers, status
        self.out: ChunkedStream | None = None
        if not numbering.skip:
            self.out = request.stream(headers, status)
        self.rest = bytearray()     # an event whose end has not come yet
        self.error: bytes | None = None   # the last error event skipped (a resumed stream)

    async def write(self, data: bytes) -> None:
        if not self.rest and data.endswith(b"\n\n"):    # whole events: most writes
            await self._whole(data)
            return
        self.rest += data
        end = self.rest.rfind(b"\n\n")
        if end < 0:
            if len(self.rest) > MAX_ANSWER_BYTES:   # not events as we know them: as they came
                await self._send(bytes(self.rest))
                self.rest.clear()
            return
        whole = bytes(self.rest[:end + 2])
        del self.rest[:end + 2]
        await self._whole(whole)

    async def _whole(self, whole: bytes) -> None:
        if self.out is None:
            if self.request.conn.transport.is_closing():   # gone while its events are skipped
                raise ConnectionResetError("the client closed the connection")
            if _UNCOUNTED[0] in whole:
                self.error = whole[whole.rindex(_UNCOUNTED[0]):].split(b"\n\n", 1)[0]
        await self._send(self.numbering.events(whole))

    async def _send(self, chunk: bytes) -> None:
        if chunk and self.out is None:
            self.out = self.request.stream(self.headers, self.status)
        if chunk:
            await self.out.write(chunk)

    def end(self) -> None:
        if self.out is not None:
            self.out.end()

    def answer(self) -> Response | ChunkedStream:
        """The handler's answer: the client's stream, or why nothing was sent."""
        if self.out is not None:
            return self.out
        if self.error is not None:
            return Response(self.error[len(_DATA):].strip(), 502)
        return Response(_past_end(self.numbering), 416)


class NumberedRequest:
    """The client's request as the serving code sees it: stream() gives an EventStream,
    everything else is the client's (path, headers, X-Request-Id)."""

    def __init__(self, request, numbering: Numbering):
        self._request, self.numbering = request, numbering

    def stream(self, headers: dict, status: int = 200) -> EventStream:
        return EventStream(self._request, self.numbering, headers, status)

    def __getattr__(self, name: str):
        return getattr(self._request, name)


def numbered(resp, numbering: Numbering):
    """The answer to send for a streamed request's answer `resp`: an EventStream's, or a
    whole SSE body (a context worker ended the request) numbered the same way."""
    if isinstance(resp, EventStream):
        return resp.answer()
    if resp.status != 200 or not resp.content_type.startswith("text/event-stream"):
        return resp
    body = numbering.events(resp.body) if resp.body.endswith(b"\n\n") else resp.body
    if numbering.past_end:
        return Response(_past_end(numbering), 416)
    return Response(body, resp.status, resp.content_type, resp.headers)


def _past_end(n: Numbering) -> bytes:
    return error_body(f"{LAST_EVENT_ID} names event {n.skip}; this stream has {n.count}",
                      "invalid_request_error", LAST_EVENT_ID)
