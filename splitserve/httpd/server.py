"""A small HTTP/1.1 server for the worker front-end and the orchestrator: one handler coroutine receives every
request (routing and error mapping are the application's), whole responses go out in one
write, streams as chunks.

It exists for the cost per request on a single event loop: the generation front-end
answers thousands of small relayed requests a second, and a general web framework's
per-request machinery (router, middleware chain, request/response objects with multidicts
and payload streams, ASGI's scope dicts and receive/send events) cost more than the work
itself (docs/reliability.md compares it with uvicorn's; docs/benchmarks.md, section 4, has
its cost per request).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Callable, NamedTuple

import msgspec

from splitserve.httpd.connections import Connections, Standing
from splitserve.httpd.cors import CORS
from splitserve.httpd.limits import HTTPLimits, connection_budget, raise_fd_limit
from splitserve.httpd.messages import Request, Response
from splitserve.httpd.protocol import HTTPConnection
from splitserve.httpd.router import ErrorBody, Handler

logger = logging.getLogger(__name__)

REPORT_EVERY = 60.0     # s between two log lines about evicted connections or failed accepts


class Admission(NamedTuple):
    """A request head the application accepts: what it shows of its sender, and the bytes
    of body it may send."""
    standing: Standing
    max_body: int


HeadCheck = Callable[[Request], "Admission | Response"]


def plain_error_body(message: str, status: int) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "status": status}})


class HTTPServer:
    """`error_body` shapes the bodies of the answers the server gives by itself (400, 408,
    413, 431, 503, 500): the application's error format. `check_head` sees every request
    once its head is in, before any of its body: it answers a Response to refuse it, or an
    Admission (by default every request is a client's, with up to max_body_bytes of body).
    `other_fds`: file descriptors the process needs besides this server's connections
    (the orchestrator's connections to its workers)."""

    def __init__(self, handler: Handler, max_body_bytes: int, log_prefix: str = "http",
                 limits: HTTPLimits = HTTPLimits(), error_body: ErrorBody = plain_error_body,
                 check_head: HeadCheck | None = None, other_fds: int = 0,
                 allowed_origins: tuple[str, ...] = ()):
        self.handler, self.max_body_bytes, self.log_prefix = handler, max_body_bytes, log_prefix
        self.limits, self.error_body, self.other_fds = limits, error_body, other_fds
        self.check_head = check_head or self._any_client
        self.cors = CORS(allowed_origins) if allowed_origins else None
        if self.cors is not None:
            self._answer_preflights()
        self.connections = Connections(limits.max_connections, limits.max_connections,
                                       limits.max_unproven_per_client)
        self.closing = False
        self.refused_connections = 0
        self.lingering = 0          # refused connections still reading what their client sent
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task | None = None
        self._reported = (0.0, 0)   # (loop time, connections evicted) of the last report

    def _any_client(self, request: Request) -> Admission:
        return Admission(Standing.CLIENT, self.max_body_bytes)

    def _answer_preflights(self) -> None:
        """A CORS preflight from an allowed origin is answered here, before the
        application's head check (it carries no API key) and handler."""
        cors, check_head, handler = self.cors, self.check_head, self.handler

        def check(request: Request) -> Admission | Response:
            if cors.is_preflight(request):
                return Admission(Standing.UNPROVEN, 0)
            return check_head(request)

        async def answer(request: Request):
            return cors.preflight(request) if cors.is_preflight(request) else await handler(request)
        self.check_head, self.handler = check, answer

    async def start(self, host: str, port: int, backlog: int, reuse_port: bool = False) -> None:
        """reuse_port: SO_REUSEPORT, for several processes listening on one port (the kernel
        spreads connections over them; server/frontends.py)."""
        loop = asyncio.get_running_loop()
        max_public, budget, most = connection_budget(self.limits, raise_fd_limit(),
                                                     self.other_fds)
        if max_public < self.limits.max_connections:
            logger.warning("%s: the file descriptor limit leaves room for %d client connections "
                           "(not %d); raise it (ulimit -n) for more", self.log_prefix,
                           max_public, self.limits.max_connections)
        self.connections.max_public, self.connections.budget = max_public, budget
        _quiet_accept_failures(loop)
        burst = min(backlog, most)
        self._server = await loop.create_server(lambda: HTTPConnection(self), host, port,
                                                backlog=burst, reuse_address=True,
                                                reuse_port=reuse_port or None)
        if burst < backlog and type(loop).__module__.startswith("asyncio"):
            # asyncio's loop accepts at most `backlog` connections per wake-up (the number
            # it was given), so the kernel's queue may be deeper: connections waiting there
            # hold no descriptor of ours, and clients arriving in a flood are queued rather
            # than dropped (a dropped SYN costs a client a second). uvloop accepts all that
            # wait, so its queue stays at the burst.
            for sock in self._server.sockets:
                raw = socket.socket(fileno=sock.fileno())
                raw.listen(backlog)
                raw.detach()        # (the fd stays the server's)
        self._sweeper = asyncio.create_task(self._sweep())

    def error_response(self, message: str, status: int, **headers: str) -> Response:
        return Response(self.error_body(message, status), status, headers=headers or None)

    def connection_refusal(self) -> Response:
        """The answer to a connection past max_connections, before it sends anything."""
        self.refused_connections += 1
        limit = self.connections.max_public
        if self.refused_connections & (self.refused_connections - 1) == 0:   # 1, 2, 4, ...
            logger.warning("%s: %d connections open, the limit: refused %d so far",
                           self.log_prefix, limit, self.refused_connections)
        return self.error_response(
            f"the server is at its limit of {limit} connections; retry later", 503,
            **{"Retry-After": "1"})

    async def _sweep(self) -> None:
        """Expire connections: silent past first_byte_timeout, idle past keepalive_timeout,
        or a request that stopped arriving (checked every quarter of the shortest timeout)."""
        loop = asyncio.get_running_loop()
        limits = self.limits
        period = min(limits.keepalive_timeout, limits.first_byte_timeout, limits.head_timeout,
                     limits.body_timeout, limits.send_timeout) / 4
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            for conn in self.connections:
                conn.expire(now)
            self._report_evictions(now)

    def _report_evictions(self, now: float) -> None:
        """One line a minute at most, however many connections were evicted."""
        at, count = self._reported
        evicted = self.connections.evicted
        if evicted > count and now - at >= REPORT_EVERY:
            self._reported = now, evicted
            logger.warning("%s: %d idle or unauthenticated connections closed to make room "
                           "(limits: %d client connections, %d unauthenticated per address)",
                           self.log_prefix, evicted - count, self.connections.max_public,
                           self.connections.per_client)

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    async def close(self, grace: float = 5.0) -> None:
        """Stop accepting; let requests being answered finish for up to `grace` seconds
        (idle connections close at once), then close every connection, which cancels
        whatever is still running."""
        if self._server is None:
            return
        self.closing = True
        self._sweeper.cancel()
        self._server.close()
        for conn in self.connections:
            if conn.task is None:
                conn.transport.close()
        deadline = time.monotonic() + grace
        while any(c.task is not None for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for conn in self.connections:
            conn.transport.close()
        await asyncio.sleep(0)      # connection_lost callbacks run: handler tasks cancelled
        self._server = None


def _quiet_accept_failures(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio's loop logs a traceback for every accept() that fails for want of a file
    descriptor (thousands a second under a connection flood, and it retries on its own):
    log one line a minute instead. Other errors go to the handler there was."""
    previous = loop.get_exception_handler()
    if getattr(previous, "quiets_accept", False):
        return
    state = {"at": -REPORT_EVERY, "count": 0}

    def handler(loop, context):
        if "out of system resource" not in context.get("message", ""):
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        state["count"] += 1
        now = loop.time()
        if now - state["at"] >= REPORT_EVERY:
            logger.warning("accept() failed %d times: %s (file descriptors exhausted)",
                           state["count"], context.get("exception"))
            state["at"], state["count"] = now, 0

    handler.quiets_accept = True
    loop.set_exception_handler(handler)
