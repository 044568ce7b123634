"""One HTTP/1.1 connection: httptools parses the bytes, one handler task runs at a time, and
responses leave in request order (pipelined requests wait their turn).

Per request this costs a parser pass (C), a handful of callbacks, two clock reads, one task
and one transport.write for a whole response. Bodies are buffered up to the server's limit;
a larger one is answered 413 after it has been read past (or at once when the client waits
on `Expect: 100-continue`), so the client sees the answer rather than a reset.

Whatever ends a connection early (a malformed or oversized request, one that stops arriving)
is answered in turn, after the responses to the requests before it, and nothing more is
read. Reading pauses while `max_pipelined` requests wait; a response is not started while
the client has not read the one before it (the transport is paused for writing), so a
connection holds at most one unread response and a few requests.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from typing import TYPE_CHECKING

import httptools

from splitserve.httpd.messages import ChunkedStream, Request, Response
from splitserve.httpd.reader import BODY, HEAD, Refusal, RequestReader

if TYPE_CHECKING:
    from splitserve.httpd.server import HTTPServer

logger = logging.getLogger(__name__)

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LINGER = 2.0           # s a refused connection reads and drops what its client still sends


class HTTPConnection(RequestReader, asyncio.Protocol):
    def __init__(self, server: HTTPServer):
        self.server, self.limits = server, server.limits
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[Request | Response] = deque()
        self.task: asyncio.Task | None = None       # the handler of the request being answered
        self.stream: ChunkedStream | None = None    # its chunked response, once started
        self.write_paused, self.write_paused_since = False, 0.0
        self._read_paused = False                   # max_pipelined requests wait
        self._stopped = False                       # nothing more is read: closes after queue
        self._drain_waiter: asyncio.Future | None = None
        self.reading, self.reading_since = 0, 0.0   # HEAD or BODY arriving since (loop time)
        self._head_bytes = 0                        # of the head arriving
        self._overhead = 0                          # of the chunked body arriving, not body
        self._continue = False                      # 100 Continue waits for earlier responses
        self.idle_since: float | None = None        # loop time it last went idle; None: busy
        self._last: Request | None = None           # the request parsed last
        self._begin()

    # -- transport events -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        if len(self.server.connections) >= self.limits.max_connections:
            transport.write(self.server.connection_refusal().encode(keep_alive=False))
            self._linger()
            return
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
        self.write_paused, self.write_paused_since = True, self.loop.time()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writer(None)

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its high-water mark."""
        if self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self._drain_waiter = self.loop.create_future()
        await self._drain_waiter

    def _wake_writer(self, exc: Exception | None) -> None:
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None) if exc is None else waiter.set_exception(exc)

    def data_received(self, data: bytes) -> None:
        if self._stopped:
            return
        self.idle_since = None
        if self.reading == BODY:
            self._overhead += len(data)     # on_body takes the body's part back out
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # Upgrades (h2c, websocket) are not offered: the request that asked is answered
            # as plain HTTP/1.1 (it is parsed already), and the connection closes after it;
            # whatever the client sends meanwhile is not HTTP/1.1 and is not read.
            if self._last is not None:
                self._last.keep_alive = False
            self._stop_reading()
            return
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, Refusal):
                self.refuse(cause.status, cause.message)
            else:
                self.refuse(400, f"malformed HTTP request: {exc}")
            return
        self._check_sizes(len(data))

    # -- httptools callbacks (the rest in reader.py) ---------------------------------------
    def on_headers_complete(self) -> None:
        self.reading, self.reading_since, self._overhead = BODY, self.loop.time(), 0
        if self._expect and self._too_large:   # the client waits for our word: refuse now
            raise Refusal(413, self._too_large_message())
        if self._expect:
            if self.task is None and not self.queue:
                self.transport.write(CONTINUE)
            else:   # never inside the responses before it: sent when they are (_next)
                self._continue = True

    def on_message_complete(self) -> None:
        self.reading, self._continue = 0, False
        if self.transport.is_closing():
            return
        self._last = self._take_request()
        self.queue.append(self._last)
        if self.task is None:
            self._next()
        elif len(self.queue) >= self.limits.max_pipelined and not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()

    # -- answering --------------------------------------------------------------------------
    def _next(self) -> None:
        """Start answering the next queued request, or wait for one."""
        self.task = None
        if self._read_paused and len(self.queue) <= self.limits.max_pipelined // 2:
            self._read_paused = False
            if not self._stopped:
                self.reading_since = self.loop.time()   # its clock stood while we did not read
                self.transport.resume_reading()
        if not self.queue:
            if self._continue:      # the request waiting for it is next
                self._continue, self.reading_since = False, self.loop.time()
                self.transport.write(CONTINUE)
            self._wait_idle()
            return
        item = self.queue.popleft()
        if isinstance(item, Response):                 # a refusal: the connection ends here
            self.transport.write(item.encode(keep_alive=False))
            self._linger()
            return
        self.task = self.loop.create_task(self._answer(item))

    async def _answer(self, request: Request) -> None:
        try:
            response = await self.server.handler(request)
        except Exception:   # the handler maps errors to responses; this is a last resort
            logger.exception("%s: %s %s failed", self.server.log_prefix, request.method,
                             request.path)
            response = self.server.error_response("internal error", 500)
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
        if not keep_alive:
            self.transport.close()
            return
        if self.write_paused:   # the client is not reading: hold the next response back
            try:
                await self.drain()
            except ConnectionResetError:
                return
        self._next()

    def refuse(self, status: int, message: str) -> None:
        """Answer `status` once the requests before are answered, then close: the byte stream
        no longer holds trustworthy request boundaries, or the client is too slow."""
        if self._stopped or self.transport.is_closing():
            return
        self._stop_reading()
        self.queue.append(self.server.error_response(message, status))
        if self.task is None:
            self._next()

    def _stop_reading(self) -> None:
        self._stopped, self.reading, self._continue = True, 0, False
        self.transport.pause_reading()

    def _linger(self) -> None:
        """Close after a refusal without a reset: closing with unread input resets the
        connection, and a client still sending would lose our answer with it. So: no more
        writes (FIN after the answer), drop whatever arrives, abort after LINGER seconds."""
        self._stopped = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.transport.resume_reading()
        self.loop.call_later(LINGER, self.transport.abort)

    def expire(self, now: float) -> None:
        """The server's sweep (a timestamp per request, not a timer): a keep-alive connection
        idle past keepalive_timeout closes; a request whose head or body stopped arriving is
        answered 408; one whose client has read nothing for send_timeout is dropped. A clock
        stands while the server is the one not reading."""
        limits = self.limits
        if self.write_paused and now - self.write_paused_since > limits.send_timeout:
            logger.info("%s: a client read nothing for %g s: connection dropped",
                        self.server.log_prefix, limits.send_timeout)
            self.transport.abort()
        elif self.reading:
            if self._read_paused or self._continue:
                return
            limit = limits.head_timeout if self.reading == HEAD else limits.body_timeout
            if now - self.reading_since > limit:
                part = "line and headers" if self.reading == HEAD else "body"
                self.refuse(408, f"the request {part} did not arrive within {limit:g} s")
        elif self.idle_since is not None and now - self.idle_since > limits.keepalive_timeout:
            self.transport.close()

    def _wait_idle(self) -> None:
        """Idle until the next request (expire() closes it after keepalive_timeout)."""
        if self.server.closing:
            self.transport.close()
        else:
            self.idle_since = self.loop.time()
