"""A parsed HTTP request, a whole response, and a chunked (SSE) response stream.

A request exists from the moment its head is in (the server's head check sees it, without
a body); its body is complete before a handler runs (the connection buffers it, within its
route's limit), so `request.body` is plain bytes and reading it costs nothing.
"""

from __future__ import annotations

import time
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING

import msgspec

from splitserve.httpd.request_id import HEADER, request_id

if TYPE_CHECKING:
    from splitserve.httpd.protocol import HTTPConnection

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_date = [0, b""]   # [second, b"Date: ...\r\n"]: formatted once a second, not per response


def response_head(status: int, framing: bytes, headers: dict[str, str] | None,
                  keep_alive: bool, echo: bytes = b"") -> bytes:
    """Everything before a response's body: the status line, Date and Server, `framing`
    (Content-Type and Content-Length, or Transfer-Encoding), the handler's headers, the
    header lines every answer to its request carries (`echo`: Request.echo), and
    Connection: close when the connection ends after this response."""
    now = int(time.time())
    if now != _date[0]:
        stamp = formatdate(now, usegmt=True).encode()
        _date[:] = now, b"Date: %s\r\nServer: splitserve\r\n" % stamp
    extra = echo
    if headers:
        extra += "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1")
    return b"HTTP/1.1 %d %s\r\n%s%s%s%s\r\n" % (
        status, _REASONS.get(status, b"Unknown"), _date[1], framing, extra,
        b"" if keep_alive else b"Connection: close\r\n")


class Request:
    """`outcome`: what the handler tells the request's log line (tokens, TTFT), or None."""

    __slots__ = ("method", "path", "query", "raw_headers", "body", "keep_alive", "conn",
                 "content_length", "_id", "outcome")

    def __init__(self, method: str, target: bytes, raw_headers: list[tuple[bytes, bytes]],
                 body: bytes, keep_alive: bool, conn: HTTPConnection,
                 content_length: int | None = None):
        path, _, query = target.partition(b"?")
        self.method, self.path, self.query = method, path.decode("latin-1"), query
        self.raw_headers, self.body, self.keep_alive = raw_headers, body, keep_alive
        self.conn = conn
        self.content_length = content_length    # as declared; None: chunked or none
        self._id: str | None = None
        self.outcome = None

    @property
    def id(self) -> str:
        """Its X-Request-Id: the client's if plain, else a new one (request_id.py); made
        once, when first asked for, and echoed on its answer."""
        if self._id is None:
            self._id = request_id(self.header(HEADER))
        return self._id

    def echo(self) -> bytes:
        """The header lines every answer to it carries: its X-Request-Id (plain characters
        only), and for a browser of an allowed origin the CORS headers (cors.py)."""
        echoed = b"X-Request-Id: %s\r\n" % self.id.encode("ascii")
        cors = self.conn.server.cors if self.conn is not None else None
        if cors is not None:
            echoed += "".join(f"{k}: {v}\r\n" for k, v in cors.echo(self).items()).encode(
                "latin-1")
        return echoed

    def header(self, name: str) -> str | None:
        """The first value of header `name` (any case), or None. Headers stay raw bytes until
        asked for: a request usually needs one or two of them."""
        want = name.lower().encode("latin-1")
        for key, value in self.raw_headers:
            if key.lower() == want:
                return value.decode("latin-1")
        return None

    def stream(self, headers: dict[str, str], status: int = 200) -> ChunkedStream:
        """Send the status line and headers now; the body follows in chunks."""
        return ChunkedStream(self.conn, status, headers, self.keep_alive, self.echo())


class Response:
    """A whole response: written with one transport.write (status line, headers, body)."""

    __slots__ = ("status", "body", "content_type", "headers", "echo")

    def __init__(self, body: bytes = b"", status: int = 200,
                 content_type: str = "application/json", headers: dict[str, str] | None = None):
        self.status, self.body, self.content_type = status, body, content_type
        self.headers = headers
        self.echo = b""     # the header lines every answer to its request carries, if known

    def encode(self, keep_alive: bool, head_only: bool = False, echo: bytes = b"") -> bytes:
        """head_only: the answer to a HEAD request, the headers a GET would get and no body;
        echo: the header lines every answer to its request carries (Request.echo)."""
        framing = b"Content-Type: %s\r\nContent-Length: %d\r\n" % (
            self.content_type.encode("latin-1"), len(self.body))
        head = response_head(self.status, framing, self.headers, keep_alive,
                             echo or self.echo)
        return head if head_only else head + self.body


def json_response(obj, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status)


class ChunkedStream:
    """A response body sent as it is produced (Transfer-Encoding: chunked). write() waits
    while the client reads slower than we write, and raises ConnectionResetError once the
    client has gone, so a handler streaming tokens stops (and aborts its engine request)."""

    __slots__ = ("conn", "status", "ended")

    def __init__(self, conn: HTTPConnection, status: int, headers: dict[str, str],
                 keep_alive: bool, echo: bytes = b""):
        if conn.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self.conn, self.status, self.ended = conn, status, False
        conn.stream = self
        conn.transport.write(response_head(status, b"Transfer-Encoding: chunked\r\n", headers,
                                           keep_alive, echo))

    async def write(self, data: bytes) -> None:
        if not data:
            return
        conn = self.conn
        if conn.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        conn.transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        if conn.write_paused:
            await conn.drain()

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            if not self.conn.transport.is_closing():
                self.conn.transport.write(b"0\r\n\r\n")
