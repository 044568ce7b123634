"""splitserve.httpd's connection rules over real sockets (uvloop, the worker's loop): who
is kept when connections run short (httpd/connections.py), the head check that runs before a
body byte is read, the first-byte timeout, half-closed clients, and failed accepts."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import pytest
import uvloop
from test_httpd import LIMIT, App, read_response, request

from splitserve.httpd import HTTPLimits, HTTPServer, Request, Response
from splitserve.httpd.connections import Standing
from splitserve.httpd.limits import connection_budget
from splitserve.httpd.server import Admission, _quiet_accept_failures


def check_head(request: Request) -> Admission | Response:
    """`X-Key: client` or `X-Key: internal` shows a credential; `X-Key: wrong` is a 401."""
    key = request.header("X-Key")
    if key == "wrong":
        return Response(b'{"error": "key"}', 401)
    standing = {"client": Standing.CLIENT, "internal": Standing.INTERNAL}.get(key)
    return Admission(Standing.UNPROVEN if standing is None else standing, LIMIT)


async def serve(app=None, **limits) -> HTTPServer:
    server = HTTPServer(app or App(), LIMIT, "test", HTTPLimits(**limits), check_head=check_head)
    await server.start("127.0.0.1", 0, 128)
    return server


async def connect(server: HTTPServer, key: str | None = None, path: str = "/a"):
    """A new connection; with `key`, one request sent and answered on it first."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    if key is not None:
        writer.write(request("GET", path, extra=f"X-Key: {key}\r\n"))
        if path != "/slow":
            assert (await asyncio.wait_for(read_response(reader), 10))[0] == 200
    return reader, writer


async def closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), 10) == b""
    except ConnectionResetError:
        return True


def run(coro):
    return uvloop.run(coro)


def test_one_address_keeps_a_few_unproven_connections_and_its_keyed_ones():
    """Past max_unproven_per_client, a new connection closes its address's oldest one that
    showed nothing; connections that showed the key are not counted."""
    async def main():
        server = await serve(max_unproven_per_client=3)
        keyed = [await connect(server, "client") for _ in range(4)]
        silent = [await connect(server) for _ in range(3)]
        newest = await connect(server)
        first_gone = await closed(silent[0][0])
        newest[1].write(request("GET", "/a", extra="X-Key: client\r\n"))
        status = (await asyncio.wait_for(read_response(newest[0]), 10))[0]
        keyed[0][1].write(request("GET", "/a", extra="X-Key: client\r\n"))
        again = (await asyncio.wait_for(read_response(keyed[0][0]), 10))[0]
        held = len(server.connections)
        await server.close()
        return first_gone, status, again, held

    first_gone, status, again, held = run(main())
    assert first_gone and status == 200 and again == 200
    assert held == 4 + 2 + 1


def test_a_connection_that_sends_nothing_is_closed_after_first_byte_timeout():
    async def main():
        server = await serve(first_byte_timeout=0.4, keepalive_timeout=30)
        silent = await connect(server)
        keyed = await connect(server, "client")     # idle too, but it sent a request
        gone = await closed(silent[0])
        kept = not keyed[0].at_eof() and len(server.connections) == 1
        await server.close()
        return gone, kept

    assert run(main()) == (True, True)


def test_the_clusters_own_traffic_gets_in_when_clients_hold_every_connection():
    """Clients hold max_connections, each being answered (none can be closed): a connection
    that shows the internal credential is still served, a client's is answered 503."""
    async def main():
        app = App()
        server = await serve(app, max_connections=3)
        held = [await connect(server, "client", "/slow") for _ in range(3)]
        while sum(c.task is not None for c in server.connections) < 3:
            await asyncio.sleep(0.01)
        internal = [await connect(server, "internal") for _ in range(5)]
        client = await connect(server)
        client[1].write(request("GET", "/a", extra="X-Key: client\r\n"))
        refused = (await asyncio.wait_for(read_response(client[0]), 10))[0]
        app.release.set()
        answered = [(await asyncio.wait_for(read_response(r), 10))[0] for r, _ in held]
        await server.close()
        return len(internal), refused, answered

    assert run(main()) == (5, 503, [200, 200, 200])


@pytest.mark.parametrize("expect", [False, True])
def test_a_refused_head_is_answered_before_its_body_is_read(expect):
    """The head check's 401 arrives while the client is still sending (no 100 Continue
    before it); what the client sends after is dropped, then the connection closes."""
    async def main():
        server = await serve()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /a HTTP/1.1\r\nHost: x\r\nX-Key: wrong\r\nContent-Length: %d\r\n%s\r\n"
                     % (LIMIT, b"Expect: 100-continue\r\n" if expect else b""))
        if not expect:
            writer.write(b"x" * 100)
        answer = await asyncio.wait_for(read_response(reader), 10)
        writer.write(b"x" * (LIMIT - 100))
        gone = await closed(reader)
        await server.close()
        return answer, gone

    (status, headers, body), gone = run(main())
    assert status == 401 and body == b'{"error": "key"}' and headers["connection"] == "close"
    assert gone


def test_a_declared_body_longer_than_its_route_reads_is_refused_at_once():
    async def main():
        server = await serve()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\nxx" % (LIMIT + 1))
        answer = await asyncio.wait_for(read_response(reader), 10)   # the body never came
        await server.close()
        return answer

    status, _, body = run(main())
    assert status == 413 and json.loads(body)["error"]["message"] == \
        f"request body too large (limit {LIMIT} bytes)"


@pytest.mark.parametrize("path", ["/a", "/slow"])
@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_a_half_closed_client_is_answered(path, version):
    """A request, then shutdown(SHUT_WR): the answer still arrives (after a `100 Continue`
    that probes whether the client is there, for HTTP/1.1 only), then the close."""
    async def main():
        app = App()
        server = await serve(app)
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(f"GET {path} HTTP/{version}\r\nHost: x\r\nX-Key: client\r\n\r\n".encode())
        sock.shutdown(socket.SHUT_WR)
        if path == "/slow":
            await asyncio.wait_for(app.started.wait(), 10)
            await asyncio.sleep(0.3)               # the probe went out; the client is there
            app.release.set()
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        received = b""
        while chunk := await asyncio.wait_for(loop.sock_recv(sock, 65536), 10):
            received += chunk
        sock.close()
        await server.close()
        return received, app.cancelled.is_set()

    received, cancelled = run(main())
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    probed = path == "/slow" and version == "1.1"
    assert received.startswith(interim) == probed and not cancelled
    assert received.removeprefix(interim).startswith(b"HTTP/1.1 200 OK")


def test_the_budget_leaves_descriptors_for_a_burst_of_accepts_and_the_clusters_traffic():
    limits = HTTPLimits()
    public, budget, backlog = connection_budget(limits, 1024, other_fds=448)
    assert backlog == 56 and budget == 1024 - 128 - 448 - 56 and public == budget - 24
    assert connection_budget(limits, 1 << 20) == (8192, (1 << 20) - 128 - 2048, 2048)


def test_failed_accepts_are_one_log_line_a_minute(caplog):
    async def main():
        loop = asyncio.get_running_loop()
        _quiet_accept_failures(loop)
        _quiet_accept_failures(loop)              # (once per loop)
        for _ in range(5000):
            loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                         "exception": OSError(24, "Too many open files")})
        loop.call_exception_handler({"message": "something else"})

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records]
    assert len([m for m in lines if "accept() failed" in m]) == 1
    assert any("something else" in m for m in lines)
