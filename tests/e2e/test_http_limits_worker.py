"""A real worker process takes its HTTP limits from the command line."""

from __future__ import annotations


def test_a_worker_takes_its_http_limits_from_the_command_line():
    """`splitserve serve --max-connections 2 --request-head-timeout 1`: a third connection
    closes the oldest one that sent no whole request, a head that stops arriving gets 408."""
    import socket
    from server_utils import Worker
    w = Worker("--model", "tiny-random", "--max-connections", "2", "--request-head-timeout", "1")
    try:
        silent = [socket.create_connection(("127.0.0.1", w.port), timeout=10) for _ in range(2)]
        third = socket.create_connection(("127.0.0.1", w.port), timeout=10)
        third.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")     # never finished
        assert silent[0].recv(4096) == b""                           # closed for the third
        assert third.recv(4096).startswith(b"HTTP/1.1 408")
        for s in (third, *silent):
            s.close()
    finally:
        w.close()
