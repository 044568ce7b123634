"""Workers that answer the orchestrator with garbage, over real sockets: a real orchestrator
process in front of a CTX and a GEN that are small HTTP servers in this process, each told
how to misbehave (malformed JSON shapes, token-id comments that are not numbers, an SSE
event that never ends, an answer that never ends).

Each fault ends that one request with a clear error (a JSON error body, or an SSE error
event then [DONE] once the stream has started), and the orchestrator then serves the next
request through the same workers."""

from __future__ import annotations

import http.client
import http.server
import json
import threading

import pytest

from server_utils import Orchestrator, alive, get, stream, wait_for

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
    to a generation request is `self.answer(handler, body)`: a test sets it."""

    daemon_threads = True

    def __init__(self, answer, health=None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answer, self.health, self.requests = answer, health, 0
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
        body = json.dumps({"status": "ok", "load": {"running": 0, "waiting": 0,
                                                    "in_flight": 0}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests += 1
        try:
            self.server.answer(self, body)
        except (BrokenPipeError, ConnectionResetError):
            pass                            # the orchestrator gave up on us: as it should


def send(h, status: int, ctype: str, *parts: bytes) -> None:
    h.send_response(status)
    h.send_header("Content-Type", ctype)
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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ctx, gen = Peer(good_ctx), Peer(good_gen)
    orch = Orchestrator(tmp_path_factory.mktemp("peers"), [ctx.url], [gen.url], max_retries=0)
    yield ctx, gen, orch
    orch.close()
    ctx.shutdown()
    gen.shutdown()


def post(url: str, body: dict) -> tuple[int, dict | bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
        return r.status, (json.loads(raw) if r.getheader("Content-Type", "").startswith(
            "application/json") else raw)
    finally:
        conn.close()


def serves_normally(ctx, gen, orch) -> None:
    ctx.answer, gen.answer = good_ctx, good_gen
    assert alive(orch.proc.pid)
    status, body = post(orch.url, PROMPT)
    assert status == 200 and body["choices"][0]["text"] == "ab", body
    events = stream(orch.url + "/v1/completions", {**PROMPT, "stream": True}, headers={})
    assert events[-1] == "[DONE]" and "".join(e["choices"][0]["text"]
                                             for e in events[:-1]) == "ab", events


CTX_GARBAGE = {
    "a JSON list": lambda h, b: send_json(h, [1, 2]),
    "disaggregated_params a number": lambda h, b: send_json(h, {**HANDOFF,
                                                               "disaggregated_params": 5}),
    "kv_handle a string": lambda h, b: send_json(h, {
        **HANDOFF, "disaggregated_params": {**HANDOFF["disaggregated_params"], "kv_handle": "x"}}),
    "an answer that never ends": lambda h, b: endless(h, 200, "application/json", b'{"a": "',
                                                      b"x"),
}


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("fault", list(CTX_GARBAGE))
def test_a_ctx_answering_garbage_fails_its_request_clearly(cluster, fault, streamed):
    ctx, gen, orch = cluster
    ctx.answer = CTX_GARBAGE[fault]
    status, body = post(orch.url, {**PROMPT, "stream": streamed})
    assert status in (502, 503), (status, body)
    message = body["error"]["message"]
    assert "context worker" in message and "Traceback" not in message, message
    serves_normally(ctx, gen, orch)


# A CTX that ended the request answers whole; the orchestrator reads its choices only to
# stream them to a client that asked for a stream.
CTX_GARBAGE_TO_STREAM = {
    "choices a string": lambda h, b: send_json(h, {"id": "x", "choices": "abc"}),
    "a choice without its index": lambda h, b: send_json(h, {"id": "x", "choices": [{"text": "a"}]}),
    "a message that is a string": lambda h, b: send_json(h, {
        "id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": "hi"}]}),
}


@pytest.mark.parametrize("fault", list(CTX_GARBAGE_TO_STREAM))
def test_a_ctx_answer_that_cannot_be_streamed_fails_its_request_clearly(cluster, fault):
    ctx, gen, orch = cluster
    ctx.answer = CTX_GARBAGE_TO_STREAM[fault]
    status, body = post(orch.url, {**PROMPT, "stream": True})
    assert status == 503 and "context worker" in body["error"]["message"], (status, body)
    serves_normally(ctx, gen, orch)


def gen_stream(*parts: bytes):
    return lambda h, b: send(h, 200, "text/event-stream", *parts)


GEN_GARBAGE = {
    "token ids that are not numbers": gen_stream(b": ids 5\n\n", event("a"), b": ids 1 x\n\n",
                                                 event("b")),
    "an event that never ends": lambda h, b: endless(h, 200, "text/event-stream",
                                                     b": ids 5\n\n" + event("a") + b"data: {",
                                                     b"x"),
}


@pytest.mark.parametrize("fault", list(GEN_GARBAGE))
def test_a_gen_streaming_garbage_ends_the_stream_with_an_error(cluster, fault):
    ctx, gen, orch = cluster
    gen.answer = GEN_GARBAGE[fault]
    events = stream(orch.url + "/v1/completions", {**PROMPT, "stream": True}, headers={})
    assert events[-1] == "[DONE]", events[-3:]
    error = events[-2]["error"]
    assert "generation worker" in error["message"], error
    serves_normally(ctx, gen, orch)


def test_a_gen_whose_first_event_never_ends_fails_its_request_clearly(cluster):
    ctx, gen, orch = cluster
    gen.answer = lambda h, b: endless(h, 200, "text/event-stream", b"data: {", b"x")
    status, body = post(orch.url, {**PROMPT, "stream": True})
    assert status in (502, 503) and "generation worker" in body["error"]["message"], body
    serves_normally(ctx, gen, orch)


def test_a_gen_whole_answer_that_never_ends_fails_its_request_clearly(cluster):
    ctx, gen, orch = cluster
    gen.answer = lambda h, b: endless(h, 200, "application/json", b'{"a": "', b"x")
    status, body = post(orch.url, PROMPT)
    assert status in (502, 503) and "generation worker" in body["error"]["message"], body
    serves_normally(ctx, gen, orch)


def test_a_gen_whose_health_never_ends_is_marked_down_and_read_no_further(tmp_path):
    """/health is read up to 1 MiB (it is polled every 0.5 s for 2 s each: unbounded, that
    was gigabytes held by the orchestrator)."""
    ctx, gen = Peer(good_ctx), Peer(good_gen)
    bad = Peer(good_gen, health=lambda h: endless(h, 200, "application/json", b'{"a": "', b"x"))
    orch = Orchestrator(tmp_path, [ctx.url], [bad.url, gen.url])
    try:
        def healthy() -> list:
            return json.loads(get(orch.url + "/health")[1])["healthy"]["gen"]
        wait_for(lambda: healthy() == [gen.url], 30, "only the good GEN healthy")
        for _ in range(4):
            serves_normally(ctx, gen, orch)
        assert bad.requests == 0 and healthy() == [gen.url]
        with open(f"/proc/{orch.proc.pid}/status") as f:
            peak_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
        assert peak_kb < 400 << 10, peak_kb
    finally:
        orch.close()
        for p in (ctx, gen, bad):
            p.shutdown()
