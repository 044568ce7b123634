"""One HTTP/1.1 connection: httptools parses the bytes, one handler task runs at a time, and
responses leave in request order (pipelined requests wait their turn).

Per request this costs a parser pass (C), a handful of callbacks, two clock reads, one task
and one transport.write for a whole response. A request's head passes the server's check
(its key, its route, its declared length) before a byte of its body is buffered or a
`100 Continue` sent; bodies are buffered up to what their route reads, and a refused
request is answered at once (then the connection lingers, dropping what still arrives, so
the client reads the answer rather than a reset).

Whatever ends a connection early (a malformed or oversized request, one that stops arriving)
is answered in turn, after the responses to the requests before it, and nothing more is
read. Reading pauses while `max_pipelined` requests wait; a response is not started while
the client has not read the one before it (the transport is paused for writing), so a
connection holds at most one unread response and a few requests. A client that half-closes
(sends its requests, then shuts down its side, as some HTTP/1.0 clients and proxies do) is
answered, then the connection closes.

Which connections the server keeps at all is connections.py's.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from typing import TYPE_CHECKING

import httptools

from splitserve.httpd.connections import Standing
from splitserve.httpd.ending import CONTINUE, Ending
from splitserve.httpd.messages import ChunkedStream, Request, Response
from splitserve.httpd.reader import BODY, Refusal, RequestReader

if TYPE_CHECKING:
    from splitserve.httpd.server import HTTPServer

logger = logging.getLogger(__name__)



class HTTPConnection(RequestReader, Ending, asyncio.Protocol):
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
        self.peer: str | None = None                # the client's address
        self.created, self.received = self.loop.time(), False   # any byte yet
        self.standing, self.probation = Standing.UNPROVEN, False   # (connections.py)
        self._eof = False                           # the client sends nothing more
        self._http11 = False                        # the last request's version was 1.1
        self._lingering = False
        self._begin()

    # -- transport events -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else None
        if not self.server.connections.admit(self):
            transport.write(self.server.connection_refusal().encode(keep_alive=False))
            self._linger()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._wait_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.remove(self)
        if self._lingering:
            self.server.lingering -= 1
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
        self.received = True
        if self.idle_since is not None:
            self.idle_since = None
            self.server.connections.went_busy(self)
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
                self.refuse(cause.status, cause.message, cause.response)
            else:
                self.refuse(400, f"malformed HTTP request: {exc}")
            return
        self._check_sizes(len(data))

    # -- httptools callbacks (the rest in reader.py) ---------------------------------------
    def on_headers_complete(self) -> None:
        self.reading, self.reading_since, self._overhead = BODY, self.loop.time(), 0
        self._take_head()           # (a Refusal here: answered before any body is read)
        if self._expect:
            if self.task is None and not self.queue:
                self.transport.write(CONTINUE)
            else:   # never inside the responses before it: sent when they are (_next)
                self._continue = True

    def admitted(self, request: Request) -> int:
        """The server's check of a request whose head is in: its standing counts for the
        connection (connections.py), a refusal is raised; -> the body it may send."""
        verdict = self.server.check_head(request)
        if isinstance(verdict, Response):
            verdict.echo = request.echo()
            raise Refusal(verdict.status, "", verdict)
        standing, max_body = verdict
        connections = self.server.connections
        connections.shown(self, standing)
        if self.probation:      # admitted into the room kept for the cluster's own traffic
            if self.standing < Standing.INTERNAL and connections.over_public():
                raise Refusal(503, "", self.server.connection_refusal())
            self.probation = False
        return max_body

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
            if self._eof:           # a half-closed client: all it sent is answered
                self.transport.close()
                return
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
            self.transport.write(response.encode(keep_alive, request.method == "HEAD",
                                                 request.echo()))
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

    def refuse(self, status: int, message: str, response: Response | None = None) -> None:
        """Answer `status` (or `response`) once the requests before are answered, then
        close: the byte stream no longer holds trustworthy request boundaries, the request
        may not be served, or the client is too slow."""
        if self._stopped or self.transport.is_closing():
            return
        self._stop_reading()
        self.queue.append(response or self.server.error_response(message, status))
        if self.task is None:
            self._next()

    def _stop_reading(self) -> None:
        self._stopped, self.reading, self._continue = True, 0, False
        self.transport.pause_reading()

    def _wait_idle(self) -> None:
        """Idle until the next request (expire() closes it after keepalive_timeout)."""
        if self.server.closing:
            self.transport.close()
        else:
            self.idle_since = self.loop.time()
            self.server.connections.went_idle(self)
