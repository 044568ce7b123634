"""What operators expect of an OpenAI server: X-Request-Id on every answer and every hop,
one log line per finished request (none for a client without the key), throughput lines
while there is traffic, /version, and a busy port said in one line before anything loads."""

import asyncio
import logging

from splitserve import redact
from splitserve.orchestrator.app import Orchestrator
from splitserve.orchestrator.cluster import ClusterConfig, PoolConfig
from splitserve.request_log import Totals, log_throughput

KEY = "sk-operations-test"


async def _exchange(raw: bytes, **config) -> bytes:
    """One request to an in-process orchestrator with no worker behind (127.0.0.1:9
    refuses) -> the answer's head."""
    nowhere = PoolConfig(("http://127.0.0.1:9",))
    orch = Orchestrator(ClusterConfig(nowhere, nowhere, port=0, internal_secret="s",
                                      connect_timeout=0.5, **config))
    await orch.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", orch.http.port)
        writer.write(raw)
        head = await reader.readuntil(b"\r\n\r\n")
        writer.close()
        return head
    finally:
        await orch.stop()


def _request(path: str, rid: str | None = None, key: str | None = None) -> bytes:
    body = b'{"prompt": "hi", "max_tokens": 1}'
    headers = b"".join([b"X-Request-Id: %s\r\n" % rid.encode() if rid else b"",
                        b"Authorization: Bearer %s\r\n" % key.encode() if key else b""])
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s"
            % (path.encode(), len(body), headers, body))


def _finished(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "splitserve.requests"]


def test_a_finished_request_is_one_line_under_its_id(caplog):
    with caplog.at_level(logging.INFO, logger="splitserve.requests"):
        head = asyncio.run(_exchange(_request("/v1/completions", "abc-123")))
    assert b" 503 " in head.split(b"\r\n")[0] and b"X-Request-Id: abc-123\r\n" in head
    lines = _finished(caplog)
    assert len(lines) == 1 and "request abc-123 /v1/completions 503" in lines[0], lines


def test_no_line_for_a_client_without_the_key_and_none_when_turned_off(caplog):
    with caplog.at_level(logging.INFO, logger="splitserve.requests"):
        head = asyncio.run(_exchange(_request("/v1/completions", "nokey"), api_key=(KEY,)))
        assert b" 401 " in head.split(b"\r\n")[0] and b"X-Request-Id: nokey\r\n" in head
        asyncio.run(_exchange(_request("/v1/completions", "quiet", KEY), api_key=(KEY,),
                              disable_log_requests=True))
    assert _finished(caplog) == []


def test_throughput_lines_only_while_there_is_traffic(caplog, monkeypatch):
    # Other tests' one-letter internal secrets ("s") are whole words of "tokens/s": start
    # from no registered secret.
    monkeypatch.setattr(redact, "_values", {})
    monkeypatch.setattr(redact, "_pattern", [None])
    counts = iter([Totals(0, 0, 0, 0, 0.0)] * 3 + [Totals(100, 50, 2, 1, 0.25)] * 9)

    async def run():
        task = asyncio.create_task(log_throughput("gen:1", lambda: next(counts), 0.05))
        await asyncio.sleep(0.5)
        task.cancel()
    with caplog.at_level(logging.INFO, logger="splitserve.requests"):
        asyncio.run(run())
    lines = [m for m in _finished(caplog) if "throughput" in m]
    assert lines and "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%" in lines[0]
    assert "Avg prompt throughput: 0.0" not in lines[0]
    # the counts stop moving but requests still run: the lines go on, at 0 tokens/s
    assert "Avg generation throughput: 0.0 tokens/s" in lines[-1]


PREFLIGHT = (b"OPTIONS /v1/completions HTTP/1.1\r\nHost: x\r\nOrigin: %s\r\n"
             b"Access-Control-Request-Method: POST\r\n"
             b"Access-Control-Request-Headers: authorization, content-type\r\n\r\n")


def _headers(head: bytes) -> dict[str, str]:
    lines = head.decode("latin-1").split("\r\n")[1:]
    return {k.lower(): v for k, _, v in (line.partition(": ") for line in lines if line)}


def test_cors_answers_allowed_origins_only():
    allowed = dict(api_key=(KEY,), allowed_origins=("https://app.example",))
    head = asyncio.run(_exchange(PREFLIGHT % b"https://app.example", **allowed))
    headers = _headers(head)
    assert b" 204 " in head.split(b"\r\n")[0], head     # before the key check
    assert headers["access-control-allow-origin"] == "https://app.example"
    assert headers["access-control-allow-headers"] == "authorization, content-type"
    assert "POST" in headers["access-control-allow-methods"]
    for origin, config in ((b"https://evil.example", allowed),
                           (b"https://app.example", dict(api_key=(KEY,)))):   # default: none
        head = asyncio.run(_exchange(PREFLIGHT % origin, **config))
        assert b" 204 " not in head.split(b"\r\n")[0]
        assert "access-control-allow-origin" not in _headers(head)
    # an answer to the page's request (here a 503: no worker) lets it read the answer
    raw = _request("/v1/completions", "c1", KEY).replace(
        b"Host: x\r\n", b"Host: x\r\nOrigin: https://app.example\r\n")
    headers = _headers(asyncio.run(_exchange(raw, **allowed)))
    assert headers["access-control-allow-origin"] == "https://app.example"
    assert "X-Request-Id" in headers["access-control-expose-headers"]
    assert headers["x-request-id"] == "c1"
