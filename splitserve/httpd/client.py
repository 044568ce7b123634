"""A keep-alive HTTP/1.1 client connection that stamps `X-Sent-At` as it writes.

`bench frontend` measures the GEN front-end from the moment the sender wrote the request.
A general client (aiohttp's) stamps the header some awaits before the bytes reach the
socket; with a thousand requests in flight on a busy client loop that gap is milliseconds
and would be charged to the server. Here the stamp, the head and the body go out in one
synchronous run of code, and the client costs a fraction of the CPU, which the server
shares on a small machine.

Just enough HTTP for one server's answers: a status line, headers, and a body framed by
Content-Length or chunked transfer encoding.

With the cluster's internal secret set, a connection is opened as the orchestrator would
call the worker (trust.py): the worker's instance id learnt through the challenge on
its /health, then its token on every request; a 403 (the worker restarted) learns it again
once.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

from splitserve import envs
from splitserve.protocol.internal_api import SENT_AT_HEADER
from splitserve.trust import CHALLENGE_HEADER, IDENTITY_HEADER, INTERNAL_HEADER, Keys, new_challenge

_SENT_AT = SENT_AT_HEADER.encode()


class HTTPConnection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: bytes,
                 keys: Keys | None = None):
        self.reader, self.writer, self.host, self.keys = reader, writer, host, keys
        self.extra = b""      # header lines every request carries: the token, once learnt

    @classmethod
    async def open(cls, url: str) -> HTTPConnection:
        """A connection to url; with the internal secret set, the server's token learnt."""
        u = urlsplit(url)
        reader, writer = await asyncio.open_connection(u.hostname, u.port or 80)
        # generation_only requests are the cluster's internal ones: they carry its token
        secret = envs.internal_secret()
        conn = cls(reader, writer, u.netloc.encode(), Keys(secret) if secret else None)
        if conn.keys is not None:
            await conn.learn()
        return conn

    async def learn(self) -> None:
        """The server's instance id through a challenge on this connection, its token in
        self.extra; ConnectionError if it proves nothing."""
        nonce = new_challenge()
        self.extra = b"%s: %s\r\n" % (CHALLENGE_HEADER.encode(), nonce.encode())
        _, _, _, headers = await self._exchange(b"GET", "/health", b"", b"application/json")
        answer = headers.get(IDENTITY_HEADER.lower().encode(), b"").decode("latin-1")
        instance = self.keys.verify(nonce, answer)
        if instance is None:
            raise ConnectionError("the server did not prove that it holds the cluster's "
                                  "internal secret")
        self.extra = b"%s: %s\r\n" % (INTERNAL_HEADER.encode(), self.keys.token(instance).encode())

    def close(self) -> None:
        self.writer.close()

    async def post(self, path: str, body: bytes,
                   content_type: bytes = b"application/json") -> tuple[int, bytes, float]:
        """-> (status, body, X-Sent-At). Raises ConnectionError if the connection fails."""
        return await self.request(b"POST", path, body, content_type)

    async def request(self, method: bytes, path: str, body: bytes = b"",
                      content_type: bytes = b"application/json") -> tuple[int, bytes, float]:
        status, answer, sent_at, _ = await self._exchange(method, path, body, content_type)
        if status == 403 and self.keys is not None:   # a new instance: learn its token
            await self.learn()
            status, answer, sent_at, _ = await self._exchange(method, path, body, content_type)
        return status, answer, sent_at

    async def _exchange(self, method: bytes, path: str, body: bytes,
                        content_type: bytes) -> tuple[int, bytes, float, dict]:
        sent_at = time.time()
        self.writer.write(b"%s %s HTTP/1.1\r\nHost: %s\r\nContent-Type: %s\r\n"
                          b"Content-Length: %d\r\n%s%s: %r\r\n\r\n"
                          % (method, path.encode(), self.host, content_type, len(body),
                             self.extra, _SENT_AT, sent_at))
        self.writer.write(body)
        try:
            await self.writer.drain()
            status, answer, headers = await self._response()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            raise ConnectionError(f"bad HTTP answer: {type(exc).__name__}: {exc}") from None
        return status, answer, sent_at, headers

    async def _response(self) -> tuple[int, bytes, dict]:
        head = await self.reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head[:-4].split(b"\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        status = int(status_line.split(b" ", 2)[1])
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            body = await self._chunks()
        else:
            body = await self.reader.readexactly(int(headers.get(b"content-length", b"0")))
        if headers.get(b"connection", b"").lower() == b"close":
            self.close()
        return status, body, headers

    async def _chunks(self) -> bytes:
        parts = []
        while True:
            size = int((await self.reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
            chunk = await self.reader.readexactly(size + 2)          # data + CRLF
            if size == 0:
                return b"".join(parts)
            parts.append(chunk[:-2])
