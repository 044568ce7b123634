"""A real worker: SSE events tagged with their token ids, and a request resumed after some of
them continues the stream exactly (what the orchestrator's mid-stream migration relies on)."""

import json
import urllib.request

import pytest

from server_utils import Worker, internal, post

BODY = {"model": "tiny-random", "messages": [{"role": "user", "content": "Count to ten"}],
        "max_tokens": 14, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def worker():
    w = Worker("--model", "tiny-random", "--dtype", "float32")
    yield w
    w.close()


def raw_stream(url: str, body: dict) -> list[str]:
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json",
                                          **internal(url)})
    with urllib.request.urlopen(req, timeout=120) as r:
        return [line.decode().rstrip("\n") for line in r if line.strip()]


def ids_and_text(lines: list[str]) -> tuple[list[int], str, list[dict]]:
    ids, text, events = [], "", []
    for line in lines:
        if line.startswith(": ids "):
            ids += [int(t) for t in line[len(": ids "):].split()]
        elif line.startswith("data: {"):
            event = json.loads(line[len("data: "):])
            events.append(event)
            for c in event["choices"]:
                text += c["delta"].get("content") or ""
    return ids, text, events


def test_stream_token_ids_tag_every_token_and_resume_continues_exactly(worker):
    url = worker.url + "/v1/chat/completions"
    plain = raw_stream(url, BODY)
    assert not any(line.startswith(":") for line in plain)   # untagged unless asked
    lines = raw_stream(url, {**BODY, "disaggregated_params": {"stream_token_ids": True}})
    ids, text, _ = ids_and_text(lines)
    assert len(ids) == 14 and text == ids_and_text(plain)[1]
    for cut in (1, 6):
        head = ids_and_text(lines[:_after_ids(lines, cut)])[1]
        rest = raw_stream(url, {**BODY, "disaggregated_params": {
            "stream_token_ids": True, "resume_token_ids": ids[:cut]}})
        rest_ids, rest_text, events = ids_and_text(rest)
        assert rest_ids == ids[cut:] and head + rest_text == text
        assert events[-1]["choices"][0]["finish_reason"] == "length"


def _after_ids(lines: list[str], n: int) -> int:
    """Index just past the events that came with the n-th token id: an ids comment goes
    before the events of its tokens, so that is where the next comment starts."""
    seen = 0
    for i, line in enumerate(lines):
        if line.startswith(": ids "):
            if seen >= n:
                return i
            seen += len(line.split()) - 2
    raise AssertionError("fewer ids than asked")


@pytest.mark.parametrize("dp, param", [
    ({"resume_token_ids": []}, "resume_token_ids"),
    ({"resume_token_ids": [1] * 14}, "resume_token_ids"),
    ({"resume_token_ids": [10 ** 9]}, "resume_token_ids"),
    ({"resume_token_ids": [1], "request_type": "context_only"}, "resume_token_ids")])
def test_bad_resume_is_a_400(worker, dp, param):
    status, body = post(worker.url + "/v1/chat/completions", {**BODY, "disaggregated_params": dp})
    assert status == 400 and param in body["error"]["param"], body
