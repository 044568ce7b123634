"""A small HTTP/1.1 server for the worker front-end: one handler coroutine receives every
request (routing and error mapping are the application's), whole responses go out in one
write, streams as chunks.

It exists for the cost per request on a single event loop: the generation front-end
answers thousands of small relayed requests a second, and a general web framework's
per-request machinery (router, middleware chain, request/response objects with multidicts
and payload streams) cost more than the work itself.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from splitserve.httpd.messages import ChunkedStream, Request, Response
from splitserve.httpd.protocol import KEEPALIVE_TIMEOUT, HTTPConnection

Handler = Callable[[Request], Awaitable["Response | ChunkedStream"]]


class HTTPServer:
    def __init__(self, handler: Handler, max_body_bytes: int, log_prefix: str = "http"):
        self.handler, self.max_body_bytes, self.log_prefix = handler, max_body_bytes, log_prefix
        self.connections: set[HTTPConnection] = set()
        self.closing = False
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task | None = None

    async def start(self, host: str, port: int, backlog: int,
                    keepalive_timeout: float = KEEPALIVE_TIMEOUT) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: HTTPConnection(self), host, port,
                                                backlog=backlog, reuse_address=True)
        self._sweeper = asyncio.create_task(self._close_idle(keepalive_timeout))

    async def _close_idle(self, timeout: float) -> None:
        """Close keep-alive connections idle for longer than `timeout` seconds (checked
        every timeout / 4)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(timeout / 4)
            cutoff = loop.time() - timeout
            for conn in [c for c in self.connections
                         if c.idle_since is not None and c.idle_since < cutoff]:
                conn.transport.close()

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
