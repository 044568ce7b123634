"""The reading half of an HTTP/1.1 connection (protocol.py): httptools' callbacks collect a
request's URL, headers and body within the server's limits (head bytes, header and trailer
lines, chunk overhead, body size), and a `Refusal` stops the parser at the first breach."""

from __future__ import annotations

import httptools

from splitserve.httpd.messages import Request

HEAD, BODY = 1, 2      # the part of a request arriving, for its timeout


class Refusal(Exception):
    """Raised in a parser callback: stop parsing; the request is answered `status`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class RequestReader:
    """Mixed into HTTPConnection, which provides `limits`, `server`, `loop`, `parser`,
    `reading`/`reading_since`, `_overhead` (bytes of a chunked body that are not body: the
    reads add, on_body subtracts) and `_continue` (a 100 Continue owed), and `refuse()`."""

    def _begin(self) -> None:
        """Ready for the next message (and let go of the last one's body)."""
        self._url, self._headers, self._body = b"", [], []
        self._size, self._too_large, self._expect, self._trailers = 0, False, False, 0

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
        if key == b"content-length":
            self._too_large = value.isdigit() and int(value) > self.server.max_body_bytes
        elif key == b"expect":
            self._expect = value.lower() == b"100-continue"

    def on_body(self, chunk: bytes) -> None:
        self._overhead -= len(chunk)
        self._continue = False      # the client sends its body without waiting for ours
        if self._too_large:
            return
        self._size += len(chunk)
        if self._size > self.server.max_body_bytes:   # chunked, or longer than it said
            self._too_large, self._body = True, []
        else:
            self._body.append(chunk)

    def _take_request(self) -> Request:
        """The request just parsed (413 if its body was too large); ready for the next."""
        if self._too_large:
            raise Refusal(413, self._too_large_message())
        url = self._url
        if not url.startswith(b"/"):           # absolute form: http://host/path
            parsed = httptools.parse_url(url)
            url = (parsed.path or b"/") + (b"?" + parsed.query if parsed.query else b"")
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = Request(self.parser.get_method().decode("ascii"), url, self._headers,
                          body, self.parser.should_keep_alive(), self)
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

    def _too_large_message(self) -> str:
        return f"request body too large (limit {self.server.max_body_bytes} bytes)"
