"""server/drain.py's question to the orchestrator, over real HTTP: which generation workers
its /health lists as healthy, whatever its status, and nothing from a body it cannot read."""

import http.server
import json
import threading

import pytest

from splitserve.server.drain import _healthy_generation


class _Health(http.server.BaseHTTPRequestHandler):
    answer = (200, b"{}")

    def do_GET(self):
        status, body = self.answer
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def orchestrator():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def _says(server, status: int, body) -> list[str]:
    _Health.answer = (status, body if isinstance(body, bytes) else json.dumps(body).encode())
    return _healthy_generation(f"http://127.0.0.1:{server.server_address[1]}")


def test_the_healthy_generation_workers_are_read_from_health(orchestrator):
    healthy = {"ctx": ["http://c:1"], "gen": ["http://g:1", "http://g:2"]}
    assert _says(orchestrator, 200, {"status": "ok", "healthy": healthy}) == \
        ["http://g:1", "http://g:2"]
    # a pool empty (the draining worker left the last one): 503 with the same body
    assert _says(orchestrator, 503, {"status": "degraded",
                                     "healthy": {"ctx": ["http://c:1"], "gen": []}}) == []


@pytest.mark.parametrize("body, urls", [
    ({"healthy": {"gen": "http://g:1"}}, []), ([1, 2], []), ({}, []),
    ({"healthy": {"gen": ["http://g:1", 7, None]}}, ["http://g:1"])])
def test_odd_bodies_list_only_the_urls_they_hold(orchestrator, body, urls):
    assert _says(orchestrator, 200, body) == urls


def test_a_body_that_is_not_json_is_an_error(orchestrator):
    with pytest.raises(ValueError):
        _says(orchestrator, 200, b"<html>")
