"""The orchestrator's own HTTP: it starts without torch, and its server (splitserve/httpd/)
guards it as it guards a worker: limits on heads and bodies, errors as OpenAI bodies."""

import asyncio
import json
import subprocess
import sys

import pytest

from splitserve.orchestrator.app import MAX_BODY_BYTES, Orchestrator
from splitserve.orchestrator.cluster import ClusterConfig, PoolConfig


def test_orchestrator_imports_no_torch():
    # A proxy: torch would cost it a second or more of start-up and memory for nothing.
    # Also the command line it runs under: `splitserve orchestrator` and `up`'s parent.
    code = ("import sys, splitserve.orchestrator.app, splitserve.orchestrator.up, splitserve.cli; "
            "splitserve.cli.build_parser(); assert 'torch' not in sys.modules, 'torch'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


async def _answer(raw: bytes) -> tuple[int, bytes]:
    """One request (no worker behind: 127.0.0.1:9 refuses) -> (status, body)."""
    nowhere = PoolConfig(("http://127.0.0.1:9",))
    orch = Orchestrator(ClusterConfig(nowhere, nowhere, port=0, internal_secret="s"))
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
     b"Expect: 100-continue\r\n\r\n" % (MAX_BODY_BYTES + 1), 413),
    (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n{x}", 400),
])
def test_the_orchestrator_refuses_what_a_worker_refuses(raw, status):
    got, body = asyncio.run(_answer(raw))
    assert got == status and json.loads(body)["error"]["message"]
