"""A response's logprobs are bounded (protocol/logprob_bound.py): past 2^20 entries, prompt
and generation together, a worker answers 400 naming what to lower before any engine work,
and the orchestrator too when the body shows the count; a stream is not bounded. A large
body is built in the tokenizer pool, off the event loop."""

import asyncio
import http.client
import json
from types import SimpleNamespace

import pytest

from server_utils import Worker, post
from splitserve.protocol.cache_salt import CacheIsolation
from splitserve.protocol.engine import CompletionDelta, EngineReady, Logprob
from splitserve.protocol.openai import decode_chat_request
from splitserve.server import generate
from splitserve.server.generate import GenerateHandlers
from splitserve.server.metrics import ServerMetrics
from splitserve.tokens import PromptTokens
from splitserve.trust import Gate

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
class _Engine:
    """Answers every request with `tokens` tokens at k = 20, in one final delta."""

    def __init__(self, tokens: int):
        self.tokens = tokens
        self.ready = EngineReady("tiny", "float32", vocab_size=100, max_model_len=100_000,
                                 num_blocks=1, block_size=16)

    async def generate(self, request):
        top = [(i, -1.0 - i) for i in range(20)]
        yield CompletionDelta(request.request_id, 0, [7] * self.tokens, "x" * self.tokens,
                              logprobs=[Logprob(7, -0.5, 1, top)] * self.tokens,
                              finish_reason=1, num_prompt_tokens=len(request.prompt))


def _built_in_pool(tokens: int) -> bool:
    pooled = []

    async def in_pool(fn):
        pooled.append(fn)
        return fn()
    server = SimpleNamespace(engine=_Engine(tokens), token_text=str, model_name="tiny",
                             metrics=ServerMetrics(), in_pool=in_pool, gate=Gate(None, None),
                             isolation=CacheIsolation("none", b"k"))
    req = decode_chat_request(json.dumps({"messages": CHAT, "logprobs": True, "top_logprobs": 20,
                                          "max_tokens": tokens}).encode())
    http = SimpleNamespace(header=lambda name: None)
    handlers = GenerateHandlers(server)
    requests = handlers._engine_requests(http, req, [PromptTokens.from_list([1, 2, 3])],
                                         req.sampling_params(), None)
    resp = asyncio.run(handlers._respond(http, req, requests, (), 0.0))
    assert len(json.loads(resp.body)["choices"][0]["logprobs"]["content"]) == tokens
    return bool(pooled)


def test_a_large_body_is_built_in_the_pool_a_small_one_on_the_loop():
    per_token = 21
    assert not _built_in_pool(generate.ON_LOOP_MAX_ENTRIES // per_token)
    assert _built_in_pool(generate.ON_LOOP_MAX_ENTRIES // per_token + 1)
    assert _built_in_pool(2000)


def test_logprobs_held_by_a_front_end_cost_the_garbage_collector_nothing():
    """A response's logprobs (up to 2^20 entries) live in the front-end while its sequences
    generate: decoded, their alternatives are tuples of numbers, which a collection stops
    tracking, the pairs at one pass and the tuple of them at the next (lists would be walked,
    item by item, by every full pass on the event loop)."""
    import gc
    import msgspec
    sent = Logprob(7, -0.5, 1, [(i, -1.0 - i) for i in range(20)])
    got = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=Logprob)
    gc.collect()
    gc.collect()
    assert not gc.is_tracked(got.top) and not gc.is_tracked(got)
