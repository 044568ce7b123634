"""The reading half of an HTTP/1.1 connection (protocol.py): httptools' callbacks collect a
request's URL, headers and body within the server's limits (head bytes, header and trailer
lines, chunk overhead, the body its route reads), and a `Refusal` stops the parser at the
first breach.

The server's head check runs when the head is complete, before a body byte is kept: a
request it refuses (no API key, an unknown path, a body longer than its route reads) is
answered at once and its body is never buffered."""

from __future__ import annotations

import httptools

from splitserve.httpd.messages import Request, Response
from splitserve.httpd.router import too_large

HEAD, BODY = 1, 2      # the part of a request arriving, for its timeout


class Refusal(Exception):
    """Raised in a parser callback: stop parsing; the request is answered `status` (or
    `response`, when the application made the answer)."""

    def __init__(self, status: int, message: str, response: Response | None = None):
        super().__init__(message)
        self.status, self.message, self.response = status, message, response


class RequestReader:
    """Mixed into HTTPConnection, which provides `limits`, `server`, `loop`, `parser`,
    `reading`/`reading_since`, `_overhead` (bytes of a chunked body that are not body: the
    reads add, on_body subtracts), `refuse()` and `admitted()` (the head passed the
    server's check: -> the bytes of body this request may send)."""

    def _begin(self) -> None:
        """Ready for the next message (and let go of the last one's body)."""
        self._url, self._headers, self._body = b"", [], []
        self._size, self._length, self._expect, self._trailers = 0, None, False, 0
        self._request: Request | None = None
        self._max_body = 0

    def on_message_begin(self) -> None:
        self.reading, self.reading_since, self._head_bytes = HEAD, self.loop.time(), 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.reading == BODY:            # a trailer: bounded, then dropped
            self._trailers += 1
            if self._trailers > self.limits.max_trailers:
                raise Refusal(431, f"more than {self.limits.max_trailers} trailer lines")
            return
        self._headers.append((name, value))
        if len(self._headers) > self.limits.max_header_lines:
            raise Refusal(431, f"more than {self.limits.max_header_lines} header lines")
        key = name.lower()
        if key == b"content-length" and value.isdigit():
            self._length = int(value)
        elif key == b"expect":
            self._expect = value.lower() == b"100-continue"

    def _take_head(self) -> Request:
        """The request whose head just arrived (its body follows)."""
        url = self._url
        if not url.startswith(b"/"):           # absolute form: http://host/path
            parsed = httptools.parse_url(url)
            url = (parsed.path or b"/") + (b"?" + parsed.query if parsed.query else b"")
        self._request = Request(self.parser.get_method().decode("ascii"), url, self._headers,
                                b"", self.parser.should_keep_alive(), self, self._length)
        self._http11 = self.parser.get_http_version() == "1.1"   # 1xx may be sent to it
        self._max_body = self.admitted(self._request)
        if self._length is not None and self._length > self._max_body:
            raise Refusal(413, too_large(self._max_body))
        return self._request

    def on_body(self, chunk: bytes) -> None:
        self._overhead -= len(chunk)
        self._continue = False      # the client sends its body without waiting for ours
        self._size += len(chunk)
        if self._size > self._max_body:   # chunked, or longer than it said
            self._body = []
            raise Refusal(413, too_large(self._max_body))
        self._body.append(chunk)

    def _take_request(self) -> Request:
        """The request just parsed, with its body; ready for the next."""
        request = self._request
        request.body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._begin()
        return request

    def _check_sizes(self, n: int) -> None:
        """The bytes httptools holds of a request still arriving: an unfinished head, a
        chunked body's trailers. (Counts whole reads: a bound on memory, not an exact
        limit.)"""
        if self.reading == HEAD:
            self._head_bytes += n
            if self._head_bytes > self.limits.max_head_bytes:
                self.refuse(431, f"request line and headers exceed "
                                 f"{self.limits.max_head_bytes} bytes")
        elif self.reading == BODY and self._overhead > self.limits.max_chunk_overhead:
            self.refuse(431, f"chunk-size lines and trailers of the request body exceed "
                             f"{self.limits.max_chunk_overhead} bytes")
