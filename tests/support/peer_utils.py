"""Fake workers for the orchestrator's tests, over real sockets: small HTTP servers in the
test's process whose answers a test sets, proving who they are as a worker does
(trust.py): an answer to /health's challenge, and the response proof on an answer to a
request carrying their token; a request with another token is refused (403), as a
restarted worker refuses its previous instance's. A test may make a peer stop proving
(`proves`), or restart it (a new `instance`)."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading

import aiohttp

from server_utils import TEST_SECRET
from splitserve.trust import (CHALLENGE_HEADER, IDENTITY_HEADER, INTERNAL_HEADER, PROOF_HEADER,
                              Keys, new_instance_id)

KEYS = Keys(TEST_SECRET)

PROMPT = {"model": "tiny-random", "prompt": "Once upon a time", "max_tokens": 4}
HANDOFF = {"id": "cmpl-ctx", "object": "text_completion", "created": 1, "model": "tiny-random",
           "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}],
           "disaggregated_params": {"request_type": "context_only", "ctx_request_id": "r1",
                                    "first_gen_tokens": [5], "prompt_len": 4,
                                    "kv_handle": {"endpoint": "tcp://127.0.0.1:1"}}}
CHUNK = {"id": "cmpl-gen", "object": "text_completion", "created": 1, "model": "tiny-random"}


def event(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return b"data: " + json.dumps({**CHUNK, "choices": [choice]}).encode() + b"\n\n"


GOOD_STREAM = b": ids 5\n\n" + event("a") + b": ids 6\n\n" + event("b", "length") + \
    b"data: [DONE]\n\n"
GOOD_WHOLE = {**CHUNK, "choices": [{"index": 0, "text": "ab", "logprobs": None,
                                    "finish_reason": "length"}],
              "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}


class Peer(http.server.ThreadingHTTPServer):
    """A worker's HTTP surface (/health with a load, the generation endpoints) whose answer
    to a generation request is `self.answer(handler, body)`: a test sets it. instance: its
    id; proves: whether its answers carry the response proof."""

    daemon_threads = True

    def __init__(self, answer, health=None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answer, self.health, self.requests = answer, health, 0
        self.instance, self.proves, self.refused = new_instance_id(), True, 0
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"       # the body ends when the connection closes

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.server.health is not None:
            try:
                return self.server.health(self)
            except (BrokenPipeError, ConnectionResetError):
                return
        send_json(self, {"status": "ok", "load": {"running": 0, "waiting": 0, "in_flight": 0}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests += 1
        try:
            if self.headers.get(INTERNAL_HEADER) != KEYS.token(self.server.instance):
                self.server.refused += 1    # what a restarted worker answers its old token
                return send_json(self, {"error": {"message": "not internal"}}, 403)
            self.server.answer(self, body)
        except (BrokenPipeError, ConnectionResetError):
            pass                            # the orchestrator gave up on us: as it should


async def serve_through(config, body: dict, after: float = 0.0) -> tuple[int, bytes, str]:
    """One client request through an orchestrator in this process (config: a ClusterConfig
    on port 0), once every pool has a verified worker: (status, the answer's bytes, the
    orchestrator's /metrics text). after: seconds it keeps running (more health checks)."""
    from splitserve.orchestrator.app import Orchestrator
    orch = Orchestrator(config)
    await orch.start()
    try:
        for _ in range(100):
            if orch.pools.health()[1] == 200:
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as client:
            async with client.post(f"http://127.0.0.1:{orch.http.port}/v1/completions",
                                   json=body) as r:
                answer = r.status, await r.read()
        await asyncio.sleep(after)
        return (*answer, orch.metrics.registry.render().decode())
    finally:
        await orch.stop()


def send(h, status: int, ctype: str, *parts: bytes) -> None:
    h.send_response(status)
    h.send_header("Content-Type", ctype)
    nonce, instance = h.headers.get(CHALLENGE_HEADER), h.server.instance
    if nonce:
        h.send_header(IDENTITY_HEADER, KEYS.identity(nonce, instance))
    if h.server.proves and h.headers.get(INTERNAL_HEADER) == KEYS.token(instance):
        h.send_header(PROOF_HEADER, KEYS.proof(instance))
    h.end_headers()
    for part in parts:
        h.wfile.write(part)


def send_json(h, obj, status: int = 200) -> None:
    send(h, status, "application/json", json.dumps(obj).encode())


def endless(h, status: int, ctype: str, head: bytes, filler: bytes) -> None:
    """head, then filler until the orchestrator hangs up."""
    send(h, status, ctype, head)
    block = filler * (1 << 20)
    while True:
        h.wfile.write(block)


def good_ctx(h, body) -> None:
    send_json(h, HANDOFF)


def good_gen(h, body) -> None:
    if body.get("stream"):
        send(h, 200, "text/event-stream", GOOD_STREAM)
    else:
        send_json(h, GOOD_WHOLE)
