"""splitserve.httpd against abusive clients, over real sockets on uvloop (the worker's loop):
requests that stop arriving, too many header or trailer lines, deep pipelines, clients that
do not read, too many connections, and 100 Continue among pipelined responses."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
import uvloop
from test_httpd import LIMIT, App, read_response, request

from splitserve.httpd import HTTPLimits, HTTPServer, Request, Response

BIG = 1 << 20


class Counting(App):
    """App, plus /big: a 1 MiB whole response; counts the requests it is handed."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    async def __call__(self, request: Request):
        self.calls += 1
        if request.path == "/big":
            return Response(b"x" * BIG, content_type="text/plain")
        return await super().__call__(request)


async def serve(app, error_body=None, **limits) -> HTTPServer:
    extra = {"error_body": error_body} if error_body else {}
    server = HTTPServer(app, LIMIT, "test", HTTPLimits(**limits), **extra)
    await server.start("127.0.0.1", 0, 128)
    return server


async def connect(server: HTTPServer):
    return await asyncio.open_connection("127.0.0.1", server.port)


async def served(server: HTTPServer) -> int:
    """The status of a plain request on a new connection: the server serves others."""
    reader, writer = await connect(server)
    writer.write(request("GET", "/other"))
    status = (await asyncio.wait_for(read_response(reader), 10))[0]
    writer.close()
    return status


async def refused(reader: asyncio.StreamReader) -> tuple[int, dict, str, bool]:
    """(status, headers, error message, closed after it) of a refusal."""
    status, headers, body = await asyncio.wait_for(read_response(reader), 10)
    closed = await asyncio.wait_for(reader.read(), 10) == b""
    return status, headers, json.loads(body)["error"]["message"], closed


async def one_answer(raw: bytes) -> tuple[int, dict, bytes]:
    """Send `raw` to a new server, read one response."""
    server = await serve(App())
    reader, writer = await connect(server)
    writer.write(raw)
    answer = await asyncio.wait_for(read_response(reader), 10)
    await server.close()
    return answer


async def trickle(writer: asyncio.StreamWriter, pieces: list[bytes], pause: float) -> None:
    """Send piece by piece, until the server stops taking them."""
    for piece in pieces:
        try:
            writer.write(piece)
            await writer.drain()
        except (ConnectionError, RuntimeError):
            return
        await asyncio.sleep(pause)


def run(coro):
    return uvloop.run(coro)


SLOW_STARTS = {
    "head stops": [b"GET /a HTTP/1.1\r\nHost: x\r\n"],
    "head trickles": [b"GET /a HTTP/1.1\r\n"] + [b"X-%d: y\r\n" % i for i in range(200)],
    "body stops": [request("POST", "/a", b"x" * 100)[:-90]],
    "chunked body stops": [b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                           b"10\r\n0123456789abcdef\r\n"],
}


@pytest.mark.parametrize("case", SLOW_STARTS)
def test_a_request_that_stops_arriving_is_answered_408_and_others_are_served(case):
    async def main():
        server = await serve(App(), head_timeout=0.5, body_timeout=0.5)
        reader, writer = await connect(server)
        sending = asyncio.create_task(trickle(writer, SLOW_STARTS[case], 0.05))
        other = await served(server)
        answer = await refused(reader)      # the answer comes while the client still sends
        sending.cancel()
        await server.close()
        return other, answer

    other, (status, headers, message, closed) = run(main())
    assert other == 200
    assert status == 408 and headers["connection"] == "close" and closed
    part = "body" if "body" in case else "line and headers"
    assert message == f"the request {part} did not arrive within 0.5 s"


def test_a_timed_out_request_is_answered_after_the_one_before_it():
    async def main():
        app = App()
        server = await serve(app, head_timeout=0.3)
        reader, writer = await connect(server)
        writer.write(request("GET", "/slow") + b"GET /late HTTP/1.1\r\nHost")
        await asyncio.wait_for(app.started.wait(), 10)
        await asyncio.sleep(1.0)             # the head times out while /slow runs
        app.release.set()
        first = await asyncio.wait_for(read_response(reader), 10)
        second = await refused(reader)
        await server.close()
        return first, second, app.cancelled.is_set()

    first, (status, _, _, closed), cancelled = run(main())
    assert first[0] == 200 and json.loads(first[2])["path"] == "/slow" and not cancelled
    assert status == 408 and closed


def test_garbage_after_a_pipelined_request_is_answered_400_after_its_response():
    async def main():
        app = App()
        server = await serve(app)
        reader, writer = await connect(server)
        writer.write(request("GET", "/slow") + b"NOT HTTP\x00\r\n\r\n")
        await asyncio.wait_for(app.started.wait(), 10)
        app.release.set()
        first = await asyncio.wait_for(read_response(reader), 10)
        second = await refused(reader)
        await server.close()
        return first, second

    first, (status, _, message, closed) = run(main())
    assert first[0] == 200 and status == 400 and closed
    assert message.startswith("malformed HTTP request")


@pytest.mark.parametrize("lines,status", [(100, 200), (101, 431)])
def test_header_lines_are_capped(lines, status):
    headers = "".join(f"X-{i}: v\r\n" for i in range(lines - 2))   # + Host, Content-Length
    got, _, body = run(one_answer(request("GET", "/a", extra=headers)))
    assert got == status
    if status == 431:
        assert json.loads(body)["error"]["message"] == "more than 100 header lines"


def chunked(body: bytes, trailers: bytes) -> bytes:
    return (b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"%x\r\n%s\r\n0\r\n%s\r\n" % (len(body), body, trailers))


@pytest.mark.parametrize("count,status", [(3, 200), (32, 200), (33, 431)])
def test_trailer_lines_are_capped(count, status):
    trailers = b"".join(b"T-%d: v\r\n" % i for i in range(count))
    got, _, body = run(one_answer(chunked(b"abc", trailers)))
    assert got == status
    if status == 200:
        assert json.loads(body)["len"] == 3
    else:
        assert json.loads(body)["error"]["message"] == "more than 32 trailer lines"


def test_a_trailer_that_never_ends_is_refused():
    async def main():
        server = await serve(App(), max_chunk_overhead=16384)
        reader, writer = await connect(server)
        writer.write(chunked(b"abc", b"")[:-2] + b"X-Long: ")
        sending = asyncio.create_task(trickle(writer, [b"y" * 1024] * 64, 0.005))
        answer = await refused(reader)      # after 16 KiB of a 64 KiB trailer value
        sending.cancel()
        other = await served(server)
        await server.close()
        return answer, other

    (status, _, message, closed), other = run(main())
    assert status == 431 and closed and other == 200
    assert message == "chunk-size lines and trailers of the request body exceed 16384 bytes"


def test_reading_pauses_while_max_pipelined_requests_wait():
    async def main():
        app = App()
        server = await serve(app, max_pipelined=4)
        reader, writer = await connect(server)
        writer.write(request("GET", "/slow"))
        await asyncio.wait_for(app.started.wait(), 10)
        conn, = server.connections
        for i in range(20):       # each read alone: the next is sent once this one is queued
            writer.write(request("GET", f"/p{i}"))
            for _ in range(1000):
                if len(conn.queue) > i or conn._read_paused:
                    break
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)              # (a server that still read would take more)
        queued = len(conn.queue)
        app.release.set()
        paths = [json.loads((await asyncio.wait_for(read_response(reader), 10))[2])["path"]
                 for _ in range(21)]
        writer.close()
        await server.close()
        return queued, paths

    queued, paths = run(main())
    assert queued == 4
    assert paths == ["/slow"] + [f"/p{i}" for i in range(20)]


def test_a_client_that_does_not_read_holds_one_response_and_others_are_served():
    async def main():
        app = Counting()
        server = await serve(app, max_pipelined=4)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.connect(("127.0.0.1", server.port))
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(request("GET", "/big") * 200)    # 200 MiB of answers, never read
        buffered, stable = [], 0
        while stable < 20 and len(buffered) < 400:    # until no more requests are taken
            calls = app.calls
            await asyncio.sleep(0.05)
            buffered.append(sum(c.transport.get_write_buffer_size()
                                for c in server.connections))
            stable = stable + 1 if app.calls == calls else 0
        calls, other = app.calls, await served(server)
        got = 0
        for _ in range(200):                          # reading resumes every answer, in order
            status, _, body = await asyncio.wait_for(read_response(reader), 30)
            got += status == 200 and len(body) == BIG
        writer.close()
        await server.close()
        return max(buffered), calls, other, got

    most_buffered, calls, other, got = run(main())
    assert most_buffered <= 2 * BIG        # one response and change, not the 200 asked for
    assert calls < 50 and other == 200 and got == 200


def test_a_client_that_reads_nothing_for_send_timeout_is_dropped():
    async def main():
        app = Counting()
        server = await serve(app, send_timeout=0.5)
        _, writer = await connect(server)
        writer.write(request("GET", "/big") * 20)
        for _ in range(200):
            if app.calls and not server.connections:
                break
            await asyncio.sleep(0.05)
        left = len(server.connections)
        await server.close()
        return app.calls, left

    calls, left = run(main())
    assert 0 < calls < 20 and left == 0


def test_past_max_connections_a_busy_server_answers_503_with_the_apps_body():
    """Three connections each being answered: nothing can make room, so a fourth is kept
    only for the cluster's own traffic; its client request gets 503 and the close."""
    def app_error(message: str, status: int) -> bytes:
        return json.dumps({"error": {"message": message, "type": "overloaded",
                                     "code": status}}).encode()

    async def main():
        app = App()
        server = await serve(app, app_error, max_connections=3)
        held = [await connect(server) for _ in range(3)]
        for reader, writer in held:
            writer.write(request("GET", "/slow"))
        while sum(c.task is not None for c in server.connections) < 3:
            await asyncio.sleep(0.01)
        reader, writer = await connect(server)
        writer.write(request("GET", "/a"))
        status, headers, body = await asyncio.wait_for(read_response(reader), 10)
        closed = await asyncio.wait_for(reader.read(), 10) == b""
        app.release.set()
        answered = [(await asyncio.wait_for(read_response(r), 10))[0] for r, _ in held]
        after = await served(server)
        await server.close()
        return status, headers, json.loads(body), closed, answered, after, \
            server.refused_connections

    status, headers, body, closed, answered, after, count = run(main())
    assert status == 503 and headers["connection"] == "close" and closed
    assert headers["retry-after"] == "1" and count == 1
    assert body == {"error": {"message": "the server is at its limit of 3 connections; retry "
                              "later", "type": "overloaded", "code": 503}}
    assert answered == [200, 200, 200] and after == 200


def test_past_max_connections_the_longest_idle_connection_makes_room():
    """Keep-alive connections that wait for their next request are closed, longest idle
    first, when a new client needs the room; a connection being answered never is."""
    async def main():
        app = App()
        server = await serve(app, max_connections=3)
        idle = [await connect(server) for _ in range(2)]
        for reader, writer in idle:
            writer.write(request("GET", "/a"))
            await asyncio.wait_for(read_response(reader), 10)
        busy = await connect(server)
        busy[1].write(request("GET", "/slow"))
        await asyncio.wait_for(app.started.wait(), 10)
        statuses = [await served(server) for _ in range(2)]
        gone = [await asyncio.wait_for(r.read(), 10) == b"" for r, _ in idle]
        app.release.set()
        slow = (await asyncio.wait_for(read_response(busy[0]), 10))[0]
        await server.close()
        return statuses, gone, slow, server.connections.evicted

    statuses, gone, slow, evicted = run(main())
    assert statuses == [200, 200] and gone == [True, True]
    assert slow == 200 and evicted == 2


@pytest.mark.parametrize("first", ["/slow", "/stream?5"])
def test_100_continue_waits_for_the_responses_before_it(first):
    async def main():
        app = App()
        server = await serve(app)
        reader, writer = await connect(server)
        writer.write(request("GET", first) + b"POST /b HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        if first == "/slow":
            await asyncio.wait_for(app.started.wait(), 10)
            early = None            # nothing may arrive while /slow runs
            try:
                early = await asyncio.wait_for(reader.read(1), 0.5)
            except asyncio.TimeoutError:
                pass
            app.release.set()
            response = await asyncio.wait_for(read_response(reader), 10)
            whole = early is None and response[0] == 200
        else:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            body = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 10)
            whole = b"chunked" in head and body.count(b"data: ") == 5
        interim = await asyncio.wait_for(reader.readexactly(25), 10)
        writer.write(b"abcd")
        second = await asyncio.wait_for(read_response(reader), 10)
        writer.close()
        await server.close()
        return whole, interim, second

    whole, interim, (status, _, body) = run(main())
    assert whole, "the first response was not whole before the 100 Continue"
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert status == 200 and json.loads(body) == {
        "method": "POST", "path": "/b", "query": "", "x": None, "len": 4}


@pytest.mark.parametrize("field", ["head_timeout", "max_pipelined", "max_connections"])
def test_a_limit_that_is_not_positive_is_refused(field):
    with pytest.raises(ValueError, match=f"HTTPLimits.{field} must be positive"):
        HTTPLimits(**{field: 0})
