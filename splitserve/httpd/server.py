"""A small HTTP/1.1 server for the worker front-end and the orchestrator: one handler coroutine receives every
request (routing and error mapping are the application's), whole responses go out in one
write, streams as chunks.

It exists for the cost per request on a single event loop: the generation front-end
answers thousands of small relayed requests a second, and a general web framework's
per-request machinery (router, middleware chain, request/response objects with multidicts
and payload streams) cost more than the work itself.

Measured with `splitserve bench frontend` (tiny-random, metadata relay, ISL 32k, 64
connections, on a shared 2-core machine): 52-60 us of front-end CPU per request with the
limits of limits.py (54-59 us before them), against 83-86 us for the same handlers behind
uvicorn 0.55's httptools protocol (ASGI: scope dicts, receive/send events, a task per
request and its flow control), which serves a third fewer requests a second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import msgspec

from splitserve.httpd.limits import HTTPLimits
from splitserve.httpd.messages import ChunkedStream, Request, Response
from splitserve.httpd.protocol import HTTPConnection

logger = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable["Response | ChunkedStream"]]
ErrorBody = Callable[[str, int], bytes]   # (message, HTTP status) -> a JSON body


def plain_error_body(message: str, status: int) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "status": status}})


class HTTPServer:
    """`error_body` shapes the bodies of the answers the server gives by itself (400, 408,
    413, 431, 503, 500): the application's error format."""

    def __init__(self, handler: Handler, max_body_bytes: int, log_prefix: str = "http",
                 limits: HTTPLimits = HTTPLimits(), error_body: ErrorBody = plain_error_body):
        self.handler, self.max_body_bytes, self.log_prefix = handler, max_body_bytes, log_prefix
        self.limits, self.error_body = limits, error_body
        self.connections: set[HTTPConnection] = set()
        self.closing = False
        self.refused_connections = 0
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task | None = None

    async def start(self, host: str, port: int, backlog: int, reuse_port: bool = False) -> None:
        """reuse_port: share the port with other processes that set it (SO_REUSEPORT)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: HTTPConnection(self), host, port,
                                                backlog=backlog, reuse_address=True,
                                                reuse_port=reuse_port or None)
        self._sweeper = asyncio.create_task(self._sweep())

    def error_response(self, message: str, status: int, **headers: str) -> Response:
        return Response(self.error_body(message, status), status, headers=headers or None)

    def connection_refusal(self) -> Response:
        """The answer to a connection past max_connections, before it sends anything."""
        self.refused_connections += 1
        limit = self.limits.max_connections
        if self.refused_connections & (self.refused_connections - 1) == 0:   # 1, 2, 4, ...
            logger.warning("%s: %d connections open, the limit: refused %d so far",
                           self.log_prefix, limit, self.refused_connections)
        return self.error_response(
            f"the server is at its limit of {limit} connections; retry later", 503,
            **{"Retry-After": "1"})

    async def _sweep(self) -> None:
        """Expire connections: idle past keepalive_timeout, or a request that stopped
        arriving (checked every quarter of the shortest timeout)."""
        loop = asyncio.get_running_loop()
        limits = self.limits
        period = min(limits.keepalive_timeout, limits.head_timeout, limits.body_timeout,
                     limits.send_timeout) / 4
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            for conn in list(self.connections):
                conn.expire(now)

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
        for conn in list(self.connections):
            if conn.task is None:
                conn.transport.close()
        deadline = time.monotonic() + grace
        while any(c.task is not None for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.transport.close()
        await asyncio.sleep(0)      # connection_lost callbacks run: handler tasks cancelled
        self._server = None
