"""The orchestrator's own HTTP: it starts without torch, and its server (splitserve/httpd/)
guards it as it guards a worker: limits on heads and bodies, errors as OpenAI bodies."""

import asyncio
import json
import subprocess
import sys

import pytest

from splitserve.orchestrator.app import Orchestrator
from splitserve.orchestrator.cluster import ClusterConfig, PoolConfig


def test_orchestrator_imports_no_torch():
    # A proxy: torch would cost it a second or more of start-up and memory for nothing.
    # Also the command line it runs under: `splitserve orchestrator` and `up`'s parent.
    code = ("import sys, splitserve.orchestrator.app, splitserve.orchestrator.up, splitserve.cli; "
            "splitserve.cli.build_parser(); assert 'torch' not in sys.modules, 'torch'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


async def _answer(raw: bytes, **config) -> tuple[int, bytes]:
    """One request (no worker behind: 127.0.0.1:9 refuses) -> (status, body)."""
    nowhere = PoolConfig(("http://127.0.0.1:9",))
    orch = Orchestrator(ClusterConfig(nowhere, nowhere, port=0, internal_secret="s", **config))
    await orch.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", orch.http.port)
        writer.write(raw)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        body = await reader.readexactly(length)
        writer.close()
        return int(head.split()[1]), body
    finally:
        await orch.stop()


@pytest.mark.parametrize("raw, status", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"X-A: 1\r\n" * 101 + b"\r\n", 431),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
     b"Expect: 100-continue\r\n\r\n" % ((64 << 20) + 1), 413),    # the default limit
    (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n{x}", 400),
])
def test_the_orchestrator_refuses_what_a_worker_refuses(raw, status):
    got, body = asyncio.run(_answer(raw))
    assert got == status and json.loads(body)["error"]["message"]


def test_the_body_limit_is_the_cluster_files():
    """64 MiB by default, the workers' own default: a bigger body would reach no worker, and
    parsing it holds the event loop (a 256 MiB one: 3.3 s here)."""
    big = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + b" " * 5000
    got, body = asyncio.run(_answer(big, max_body_bytes=4096))
    assert got == 413 and b"4096" in body, body
    got, body = asyncio.run(_answer(big, max_body_bytes=8192))
    assert got == 400, body                  # read whole, then refused as not JSON
    with pytest.raises(ValueError, match="max_body_bytes"):
        ClusterConfig(PoolConfig(()), PoolConfig(()), max_body_bytes=100)


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body, param", [
    # 128 x 391 tokens x 21 entries, past 2^20 (protocol/logprob_bound.py): refused here
    ("/v1/completions", {"prompt": "hi", "n": 128, "max_tokens": 391, "logprobs": 20}, "logprobs"),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 64, "max_tokens": 391, "logprobs": 20},
     "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 128, "logprobs": True,
                              "max_completion_tokens": 8200}, "max_completion_tokens"),
    # passed on toward a worker (none here: 503): within the bound (16 tokens by default),
    # a stream, or no max_tokens (what the context leaves is the worker's to count)
    ("/v1/completions", {"prompt": "hi", "n": 128, "logprobs": 20}, None),
    ("/v1/completions", {"prompt": "hi", "n": 128, "max_tokens": 391, "logprobs": 20,
                         "stream": True}, None),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 20}, None),
])
def test_logprobs_past_the_bound_are_refused_before_a_worker_sees_them(path, body, param):
    data = json.dumps(body).encode()
    raw = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (
        path.encode(), len(data), data)
    got, answer = asyncio.run(_answer(raw))
    error = json.loads(answer)["error"]
    assert (got, error["param"]) == ((400, param) if param else (503, None)), error


def test_a_streamed_request_tells_its_context_worker():
    """whose bound on a body built whole does not apply to the client's stream"""
    from splitserve.orchestrator.relay import context_body
    assert context_body({"prompt": "hi", "stream": True}, "list")["disaggregated_params"] == {
        "request_type": "context_only", "token_relay": "list", "client_stream": True}
    assert "client_stream" not in context_body({"prompt": "hi"}, "list")["disaggregated_params"]
