"""One HTTP/1.1 connection: httptools parses the bytes, one handler task runs at a time, and
responses leave in request order (pipelined requests wait their turn).

Per request this costs a parser pass (C), a handful of callbacks, one task and one
transport.write for a whole response. Bodies are buffered up to the server's limit; a
larger one is answered 413 after it has been read past (or at once when the client waits
on `Expect: 100-continue`), so the client sees the answer rather than a reset.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from typing import TYPE_CHECKING

import httptools

from splitserve.httpd.messages import ChunkedStream, Request, Response
from splitserve.protocol.openai_responses import error_body

if TYPE_CHECKING:
    from splitserve.httpd.server import HTTPServer

logger = logging.getLogger(__name__)

KEEPALIVE_TIMEOUT = 75.0   # s an idle keep-alive connection stays open (aiohttp's, nginx's)
MAX_PIPELINED = 32         # parsed requests queued behind a running one before reading pauses
MAX_HEAD_BYTES = 1 << 20   # an unfinished request head; httptools buffers it without bound


class HTTPConnection(asyncio.Protocol):
    def __init__(self, server: HTTPServer):
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[Request | Response] = deque()
        self.task: asyncio.Task | None = None       # the handler of the request being answered
        self.stream: ChunkedStream | None = None    # its chunked response, once started
        self.write_paused = False
        self._read_paused = False
        self._drain_waiter: asyncio.Future | None = None
        self._in_head, self._head_bytes = False, 0  # a request head is still arriving; its size
        self.idle_since: float | None = None        # loop time it last went idle; None: busy
        self._last: Request | None = None           # the request parsed last
        self._begin()

    # -- transport events -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.connections.add(self)
        self._wait_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.queue.clear()
        if self.task is not None:
            self.task.cancel()          # the client went away: stop its work (engine aborts)
        self._wake_writer(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writer(None)

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its high-water mark."""
        if self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self._drain_waiter = asyncio.get_running_loop().create_future()
        await self._drain_waiter

    def _wake_writer(self, exc: Exception | None) -> None:
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None) if exc is None else waiter.set_exception(exc)

    def data_received(self, data: bytes) -> None:
        self.idle_since = None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # Upgrades (h2c, websocket) are not offered: the request that asked is answered
            # as plain HTTP/1.1 (it is parsed already), and the connection closes after it;
            # whatever the client sends meanwhile is not HTTP/1.1 and is not read.
            if self._last is not None:
                self._last.keep_alive = False
            self.transport.pause_reading()
        except httptools.HttpParserError as exc:
            self.reject(400, f"malformed HTTP request: {exc}")
            return
        if self._in_head:   # (counts the whole read: a bound on memory, not an exact limit)
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self.reject(431, f"request line and headers exceed {MAX_HEAD_BYTES} bytes")

    # -- httptools callbacks --------------------------------------------------------------
    def _begin(self) -> None:
        """Ready for the next message (and let go of the last one's body)."""
        self._url, self._headers, self._body = b"", [], []
        self._size, self._too_large, self._expect = 0, False, False

    def on_message_begin(self) -> None:
        self._in_head, self._head_bytes = True, 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))
        key = name.lower()
        if key == b"content-length":
            self._too_large = value.isdigit() and int(value) > self.server.max_body_bytes
        elif key == b"expect":
            self._expect = value.lower() == b"100-continue"

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._expect and self._too_large:   # the client waits for our word: refuse now
            self.reject(413, self._too_large_message())
        elif self._expect:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, chunk: bytes) -> None:
        if self._too_large:
            return
        self._size += len(chunk)
        if self._size > self.server.max_body_bytes:   # chunked, or longer than it said
            self._too_large, self._body = True, []
        else:
            self._body.append(chunk)

    def on_message_complete(self) -> None:
        if self.transport.is_closing():
            return
        if self._too_large:
            self.queue.append(Response(error_body(self._too_large_message()), 413))
        else:
            url = self._url
            if not url.startswith(b"/"):           # absolute form: http://host/path
                parsed = httptools.parse_url(url)
                url = (parsed.path or b"/") + (b"?" + parsed.query if parsed.query else b"")
            body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
            self._last = Request(self.parser.get_method().decode("ascii"), url, self._headers,
                                 body, self.parser.should_keep_alive(), self)
            self.queue.append(self._last)
        self._begin()
        if self.task is None:
            self._next()
        elif len(self.queue) > MAX_PIPELINED and not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()

    def _too_large_message(self) -> str:
        return f"request body too large (limit {self.server.max_body_bytes} bytes)"

    # -- answering --------------------------------------------------------------------------
    def _next(self) -> None:
        """Start answering the next queued request, or wait for one."""
        self.task = None
        if self._read_paused and len(self.queue) <= MAX_PIPELINED // 2:
            self._read_paused = False
            self.transport.resume_reading()
        if not self.queue:
            self._wait_idle()
            return
        item = self.queue.popleft()
        if isinstance(item, Response):                 # refused while parsing (413)
            self.transport.write(item.encode(keep_alive=False))
            self.transport.close()
            return
        self.task = asyncio.get_running_loop().create_task(self._answer(item))

    async def _answer(self, request: Request) -> None:
        try:
            response = await self.server.handler(request)
        except Exception:   # the handler maps errors to responses; this is a last resort
            logger.exception("%s: %s %s failed", self.server.log_prefix, request.method,
                             request.path)
            response = Response(error_body("internal error", "server_error"), 500)
        if self._last is request:
            self._last = None            # its body is not kept alive with the connection
        if self.transport.is_closing():
            return
        keep_alive = request.keep_alive and not self.server.closing
        stream, self.stream = self.stream, None
        if stream is None:
            self.transport.write(response.encode(keep_alive, request.method == "HEAD"))
        else:
            if response is not stream:   # failed after its head went out: nothing else to say
                logger.warning("%s: %s %s failed while streaming (%d)", self.server.log_prefix,
                               request.method, request.path, response.status)
                keep_alive = False
            stream.end()
        if keep_alive:
            self._next()
        else:
            self.transport.close()

    def reject(self, status: int, message: str) -> None:
        """Answer a request the parser could not take, then close: the connection's byte
        stream can no longer be trusted to hold request boundaries."""
        if not self.transport.is_closing():
            self.transport.write(Response(error_body(message), status).encode(keep_alive=False))
            self.transport.close()

    def _wait_idle(self) -> None:
        """Idle until the next request; the server's sweep closes connections idle longer
        than KEEPALIVE_TIMEOUT (a timestamp per request, not a timer)."""
        if self.server.closing:
            self.transport.close()
        else:
            self.idle_since = asyncio.get_running_loop().time()
