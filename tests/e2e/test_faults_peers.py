"""Workers that answer the orchestrator with garbage, over real sockets: a real orchestrator
process in front of a CTX and a GEN that are small HTTP servers in this process, each told
how to misbehave (malformed JSON shapes, token-id comments that are not numbers, an SSE
event that never ends, an answer that never ends).

Each fault ends that one request with a clear error (a JSON error body, or an SSE error
event then [DONE] once the stream has started), and the orchestrator then serves the next
request through the same workers.

The peers prove who they are as a worker does (peer_utils.py); one that stops proving, or
that restarted, is refused or verified again."""

from __future__ import annotations

import http.client
import json

import pytest

from peer_utils import (HANDOFF, PROMPT, Peer, endless, event, good_ctx, good_gen, send,
                        send_json)
from server_utils import Orchestrator, alive, get, stream, wait_for
from splitserve.trust import new_instance_id


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


@pytest.mark.parametrize("role", ["ctx", "gen"])
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_an_answer_without_the_response_proof_never_reaches_the_client(cluster, role, streamed):
    """A worker's answer without the proof of the instance the orchestrator verified (what a
    process that took its port after the last health check sends) is a server error: the
    worker is marked down, nothing of the answer reaches the client."""
    ctx, gen, orch = cluster
    peer = ctx if role == "ctx" else gen
    peer.proves = False
    try:
        status, body = post(orch.url, {**PROMPT, "stream": streamed})
    finally:
        peer.proves = True
    assert status == 503, (status, body)
    worker = "context worker" if role == "ctx" else "generation worker"
    assert worker in body["error"]["message"], body
    serves_normally(ctx, gen, orch)       # checked again at once: it proves itself, it serves


def test_a_restarted_gen_is_verified_again_at_once_and_serves_the_request(tmp_path):
    """A GEN that restarted since its last health check refuses the token of its previous
    instance (403): the orchestrator checks it again at once, not at the next interval
    (here ten minutes away), and the same request is served by the new instance."""
    ctx, gen = Peer(good_ctx), Peer(good_gen)
    orch = Orchestrator(tmp_path, [ctx.url], [gen.url], max_retries=1,
                        health_check_interval=600, load_poll_interval=0)
    try:
        serves_normally(ctx, gen, orch)
        gen.instance = new_instance_id()
        status, body = post(orch.url, PROMPT)
        assert status == 200 and body["choices"][0]["text"] == "ab", body
        assert gen.refused == 1          # the old token, once; then the new instance's
        serves_normally(ctx, gen, orch)
        assert gen.refused == 1
    finally:
        orch.close()
        for p in (ctx, gen):
            p.shutdown()
