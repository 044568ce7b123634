"""A response's logprobs are bounded (protocol/logprob_bound.py): past 2^20 entries, prompt
and generation together, a worker answers 400 naming what to lower before any engine work,
and the orchestrator too when the body shows the count; a stream is not bounded."""

import http.client
import json

import pytest

from server_utils import Worker, post

CHAT = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def worker():
    w = Worker("--model", "tiny-random", "--dtype", "float32")   # max_model_len 262,144
    yield w
    w.close()


def still_serves(worker) -> None:
    status, body = post(worker.url + "/v1/completions", {"prompt": "still alive?", "max_tokens": 2})
    assert status == 200, body


PAST_THE_BOUND = [
    # 128 x 391 tokens x 21 = 1,051,008 entries: fewer alternatives would do
    ("/v1/completions", {"prompt": [5, 6, 7], "n": 128, "max_tokens": 391, "logprobs": 20},
     "logprobs"),
    # counted over every prompt of a batch: 2 x 64 x 391 x 21
    ("/v1/completions", {"prompt": [[5, 6], [7, 8]], "n": 64, "max_tokens": 391, "logprobs": 20},
     "logprobs"),
    # no max_tokens: what the context leaves, ~262,000 tokens x 21
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 20},
     "top_logprobs"),
    # 8 x ~262,000 tokens, one entry each: no alternatives to drop, the length must go
    ("/v1/chat/completions", {"messages": CHAT, "n": 8, "logprobs": True}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 128, "logprobs": True,
                              "max_completion_tokens": 8200}, "max_completion_tokens"),
]


@pytest.mark.parametrize("path, body, param", PAST_THE_BOUND)
def test_past_the_bound_a_400_names_what_to_lower(worker, path, body, param):
    status, err = post(worker.url + path, body, timeout=60)
    assert status == 400 and err["error"]["param"] == param, err
    assert "1,048,576" in err["error"]["message"]
    still_serves(worker)


def test_prompt_and_generation_logprobs_share_the_bound(worker):
    """1,000 prompt tokens x n = 49 x 21 = 1,029,000 prompt entries, plus 49 x 19 x 21 =
    19,551 generated: 1,048,551, served; one more token each is refused."""
    body = {"prompt": [[7] * 1000], "n": 49, "prompt_logprobs": 20, "logprobs": 20,
            "max_tokens": 19, "ignore_eos": True}
    status, answer = post(worker.url + "/v1/completions", body)
    assert status == 200 and len(answer["choices"]) == 49, answer
    for c in answer["choices"]:
        assert len(c["prompt_logprobs"]) == 1000 and len(c["logprobs"]["tokens"]) == 19
    status, err = post(worker.url + "/v1/completions", {**body, "max_tokens": 20}, timeout=60)
    assert status == 400 and err["error"]["param"] == "logprobs", err
    still_serves(worker)


def test_a_stream_is_not_bounded(worker):
    """Its events go out a token at a time: the request over the bound above streams."""
    data = json.dumps({"messages": CHAT, "logprobs": True, "top_logprobs": 20,
                       "stream": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", worker.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", data, {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in (r.readline() for _ in range(8))
              if line.startswith(b"data: ")]
    conn.close()                     # the client goes: the worker aborts the request
    assert any(e["choices"][0]["logprobs"] for e in events), events
    still_serves(worker)


def test_a_context_worker_refuses_before_its_prefill_unless_the_client_streams(worker):
    """The orchestrator sends the prefill of a split request without the client's stream
    flag; with it (client_stream) the GEN streams, and no bound applies."""
    body = {"prompt": [5, 6, 7], "max_tokens": None, "logprobs": 20,
            "disaggregated_params": {"request_type": "context_only", "token_relay": "list"}}
    status, err = post(worker.url + "/v1/completions", body)
    assert status == 400 and err["error"]["param"] == "logprobs", err
    body["disaggregated_params"]["client_stream"] = True
    status, answer = post(worker.url + "/v1/completions", body)
    assert status == 200 and answer["disaggregated_params"]["kv_handle"], answer


# -- where a body is built -------------------------------------------------------------------
