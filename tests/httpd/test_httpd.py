"""splitserve.httpd over real sockets: keep-alive, pipelining, body limits, 100-continue,
malformed input, chunked streams, disconnects and shutdown."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from splitserve.httpd import HTTPLimits, HTTPServer, Request, Response, json_response

LIMIT = 4096


class App:
    """Echoes method, path, query, a header and the body length; /slow waits until the test
    releases it; /stream sends chunks; /boom raises."""

    def __init__(self):
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()
        self.stream_error: BaseException | None = None

    async def __call__(self, request: Request):
        if request.path == "/slow":
            self.started.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if request.path == "/boom":
            raise RuntimeError("boom")
        if request.path == "/stream":
            return await self.stream(request)
        return json_response({"method": request.method, "path": request.path,
                              "query": request.query.decode(), "x": request.header("X-Test"),
                              "len": len(request.body)})

    async def stream(self, request: Request):
        out = request.stream({"Content-Type": "text/event-stream"})
        try:
            for i in range(int(request.query or 3)):
                await out.write(b"data: %d\n\n" % i)
                await asyncio.sleep(0.01)
        except (ConnectionResetError, asyncio.CancelledError) as exc:
            self.stream_error = exc       # either stops the handler
            raise
        return out


async def serve(app, **limits):
    server = HTTPServer(app, LIMIT, "test", HTTPLimits(**limits))
    await server.start("127.0.0.1", 0, 128)
    return server


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v for k, _, v in (ln.partition(": ") for ln in lines[1:] if ln)}
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return status, headers, body


async def exchange(server: HTTPServer, raw: bytes):
    """Open a connection, send raw bytes, read one response: (response, reader, writer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(raw)
    return await read_response(reader), reader, writer


def request(method: str, path: str, body: bytes = b"", extra: str = "") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
            .encode() + body)


def run(coro):
    return asyncio.run(coro)


def test_keep_alive_and_pipelined_requests_answer_in_order():
    async def main():
        server = await serve(App())
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(request("POST", "/a?q=1", b"xyz", "X-Test: hello\r\n"))
        first = await read_response(reader)
        # two requests in one write: answered in order on the same connection
        writer.write(request("GET", "/b") + request("POST", "/c", b"12345"))
        second, third = await read_response(reader), await read_response(reader)
        writer.close()
        await server.close()
        return first, second, third

    first, second, third = run(main())
    assert first[0] == 200 and json.loads(first[2]) == {
        "method": "POST", "path": "/a", "query": "q=1", "x": "hello", "len": 3}
    assert json.loads(second[2])["path"] == "/b"
    assert json.loads(third[2])["path"] == "/c" and json.loads(third[2])["len"] == 5
    assert "connection" not in first[1]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_is_a_413_with_an_error_body(chunked):
    async def main():
        server = await serve(App())
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        body = b"x" * (LIMIT + 1)
        if chunked:
            writer.write(b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        else:
            writer.write(request("POST", "/a", body))
        status, headers, payload = await read_response(reader)
        closed = await reader.read() == b""
        # the server goes on serving other connections
        r2, w2 = await asyncio.open_connection("127.0.0.1", server.port)
        w2.write(request("POST", "/a", b"x" * LIMIT))
        ok = await read_response(r2)
        w2.close()
        await server.close()
        return status, headers, payload, closed, ok

    status, headers, payload, closed, ok = run(main())
    assert status == 413 and headers["connection"] == "close" and closed
    message = json.loads(payload)["error"]["message"]
    assert message == f"request body too large (limit {LIMIT} bytes)"
    assert ok[0] == 200 and json.loads(ok[2])["len"] == LIMIT


def test_expect_100_continue():
    async def main():
        server = await serve(App())
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                     b"Expect: 100-continue\r\n\r\n")
        interim = await reader.readuntil(b"\r\n\r\n")
        writer.write(b"abcd")
        ok = await read_response(reader)
        # too large: refused before the body is sent
        writer.write(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
                     b"Expect: 100-continue\r\n\r\n" % (LIMIT + 1))
        refused = await read_response(reader)
        writer.close()
        await server.close()
        return interim, ok, refused

    interim, ok, refused = run(main())
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert ok[0] == 200 and json.loads(ok[2])["len"] == 4
    assert refused[0] == 413


def test_malformed_request_is_a_400_and_the_server_keeps_serving():
    async def main():
        server = await serve(App())
        bad, _, _ = await exchange(server, b"GARBAGE\x00 / NOPE\r\n\r\n")
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{server.port}/fine") as r:
                good = r.status
            async with s.get(f"http://127.0.0.1:{server.port}/boom") as r:
                boom = r.status, await r.json()
        await server.close()
        return bad, good, boom

    bad, good, boom = run(main())
    assert bad[0] == 400 and "malformed HTTP request" in json.loads(bad[2])["error"]["message"]
    assert good == 200
    assert boom[0] == 500 and boom[1]["error"] == {"message": "internal error", "status": 500}


def test_http_1_0_closes_after_the_response():
    async def main():
        server = await serve(App())
        response, reader, _ = await exchange(server, b"GET /a HTTP/1.0\r\n\r\n")
        eof = await reader.read() == b""
        await server.close()
        return response, eof

    (status, headers, _), eof = run(main())
    assert status == 200 and headers["connection"] == "close" and eof


def test_a_client_going_away_cancels_its_handler():
    async def main():
        app = App()
        server = await serve(app)
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(request("GET", "/slow"))
        await asyncio.wait_for(app.started.wait(), 5)
        writer.close()
        await asyncio.wait_for(app.cancelled.wait(), 5)
        await server.close()
        return len(server.connections)

    assert run(main()) == 0


def test_chunked_stream_and_a_reader_that_leaves():
    async def main():
        app = App()
        server = await serve(app)
        url = f"http://127.0.0.1:{server.port}/stream"
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "?3") as r:
                whole = r.headers["Transfer-Encoding"], await r.read()
            async with s.get(url + "?100000") as r:
                await r.content.readexactly(8)
                r.close()                     # leaves mid-stream
        for _ in range(200):
            if app.stream_error is not None:
                break
            await asyncio.sleep(0.01)
        await server.close()
        return whole, app.stream_error

    (encoding, body), error = run(main())
    assert encoding == "chunked" and body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert isinstance(error, (ConnectionResetError, asyncio.CancelledError))


def test_close_lets_running_requests_finish_then_cancels_the_rest():
    async def main():
        app = App()
        server = await serve(app)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        idle_reader, _ = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(request("GET", "/slow"))
        await asyncio.wait_for(app.started.wait(), 5)
        closing = asyncio.create_task(server.close(grace=5))
        await asyncio.sleep(0.1)
        idle_closed = await asyncio.wait_for(idle_reader.read(), 5) == b""
        app.release.set()                     # the running request finishes within the grace
        status, headers, _ = await read_response(reader)
        await closing
        # a second server: a request still running after the grace is cancelled
        app2 = App()
        server2 = await serve(app2)
        _, w2 = await asyncio.open_connection("127.0.0.1", server2.port)
        w2.write(request("GET", "/slow"))
        await asyncio.wait_for(app2.started.wait(), 5)
        await server2.close(grace=0.1)
        await asyncio.wait_for(app2.cancelled.wait(), 5)
        return idle_closed, status, headers

    idle_closed, status, headers = run(main())
    assert idle_closed and status == 200 and headers["connection"] == "close"


def test_whole_response_encoding():
    raw = Response(b"{}", 404, headers={"X-A": "1"}).encode(keep_alive=True)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 404 Not Found" and body == b"{}"
    assert lines[1].startswith(b"Date: ") and lines[1].endswith(b" GMT")
    assert lines[2:] == [b"Server: splitserve", b"Content-Type: application/json",
                         b"Content-Length: 2", b"X-A: 1"]


def test_idle_keep_alive_connections_are_closed_after_the_timeout():
    async def main():
        server = await serve(App(), keepalive_timeout=0.2)
        response, reader, _ = await exchange(server, request("GET", "/a"))
        eof = await asyncio.wait_for(reader.read(), 5) == b""
        await server.close()
        return response[0], eof

    assert run(main()) == (200, True)


def test_an_upgrade_request_is_answered_as_http_1_1_and_the_connection_closed():
    async def main():
        server = await serve(App())
        response, reader, _ = await exchange(server, request(
            "GET", "/a", extra="Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                              "HTTP2-Settings: AAMAAABkAAQAAP__\r\n") + b"PRI * HTTP/2.0\r\n")
        eof = await asyncio.wait_for(reader.read(), 5) == b""
        await server.close()
        return response, eof

    (status, headers, body), eof = run(main())
    assert status == 200 and json.loads(body)["path"] == "/a"
    assert headers["connection"] == "close" and eof


def test_a_request_head_that_never_ends_is_refused():
    MAX_HEAD_BYTES = HTTPLimits().max_head_bytes

    async def main():
        server = await serve(App())
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /a HTTP/1.1\r\nX-Long: ")
        for _ in range(MAX_HEAD_BYTES // 65536 + 2):
            writer.write(b"x" * 65536)
            await writer.drain()
        status, _, body = await read_response(reader)
        await server.close()
        return status, json.loads(body)

    status, body = run(main())
    assert status == 431 and "headers exceed" in body["error"]["message"]


def test_head_gets_the_headers_without_the_body():
    async def main():
        server = await serve(App())
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"HEAD /a HTTP/1.1\r\nHost: x\r\n\r\n" + request("GET", "/b"))
        head = await reader.readuntil(b"\r\n\r\n")
        after = await read_response(reader)       # the next response follows at once
        writer.close()
        await server.close()
        return head, after

    head, (status, _, body) = run(main())
    assert head.startswith(b"HTTP/1.1 200 OK") and b"Content-Length: " in head
    assert status == 200 and json.loads(body)["path"] == "/b"
