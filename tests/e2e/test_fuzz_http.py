"""Fuzzing the public endpoints of a real worker and of a real cluster (orchestrator, CTX,
GEN): random JSON, every known field with wrong types and extreme values, raw number
literals JSON has no room for, deep nesting, long strings, random bytes, truncated bodies.

Whatever arrives, the answer is a response (never a dropped connection) whose status is
below 500 or 503, and afterwards the server still serves a normal request and its /health
is 200. Requests are sent with http.client, one connection each, so a reset or a close
without a response raises instead of being retried."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_utils import Orchestrator, Worker, alive, engine_pid, get, post

# Short contexts keep every valid request cheap: at most 64 tokens in and out.
MODEL = ("--model", "tiny-random", "--max-model-len", "64", "--kv-timeout", "5")
EXAMPLES = 150
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

EXTREME_INTS = st.sampled_from([
    0, 1, -1, 2, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
    -2**31, -2**63, -2**63 - 1, -2**64, 10**40, -10**40])
INTS = st.one_of(EXTREME_INTS, st.integers(-5, 200), st.integers())
FLOATS = st.one_of(
    st.sampled_from([0.0, -0.0, 0.5, 1.0, 5e-324, 1e-308, 1e308, -1e308, 1.7976931348623157e308,
                     2.0**63, 2.0**64, 1e20]),
    st.floats(allow_nan=False, allow_infinity=False))
TEXT = st.one_of(st.text(max_size=20), st.sampled_from(["", " ", "a" * 5000, "\0", "😀" * 300,
                                                        "<|im_end|>", "{{ x }}", "{% for %}"]))
JSON = st.recursive(
    st.none() | st.booleans() | INTS | FLOATS | TEXT,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(TEXT, kids, max_size=4),
    max_leaves=10)
NESTING = st.sampled_from([2, 64, 253, 254, 255, 256, 400, 900])   # orjson writes 254, reads 1024
# Spliced into the JSON text as they are: numbers and escapes no JSON encoder writes.
RAW_LITERALS = ["1e999", "-1e999", "NaN", "Infinity", "-0", "1E400", "0.0e-99999",
                "123456789012345678901234567890123456789", '"\\ud800"', '"\\udfff x"', "[" * 3000,
                "[" * 200 + "]" * 200, "{" * 300, '"' + "x" * 100_000 + '"']
RAW = "__RAW_LITERAL__"
RELAY_MODES = ["list", "b64", "metadata", "auto"]

VOCAB_IDS = st.lists(st.integers(0, 49151), min_size=1, max_size=6)
TOKEN_IDS = st.lists(st.one_of(st.integers(0, 49151), EXTREME_INTS), max_size=6)
WORDS = st.text(st.characters(codec="utf-8"), min_size=1, max_size=30)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                 "content": st.one_of(WORDS, st.lists(st.fixed_dictionaries(
                                     {"type": st.just("text"), "text": WORDS}), min_size=1,
                                     max_size=2))})
# Values a client might well send, most valid on their own.
COMMON = {
    "model": st.just("tiny-random"), "n": st.integers(1, 3), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "temperature": st.sampled_from([0, 0.7, 1.0, 2]), "top_p": st.sampled_from([0.1, 0.9, 1]),
    "stop": st.one_of(WORDS, st.lists(WORDS, max_size=3)),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100),
                                  max_size=3),
    "seed": st.integers(-2**63, 2**63 - 1), "user": WORDS, "top_k": st.integers(-1, 100),
    "min_p": st.floats(0, 1), "repetition_penalty": st.floats(0.5, 2),
    "min_tokens": st.integers(0, 1), "ignore_eos": st.booleans(), "stop_token_ids": VOCAB_IDS,
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
    "prompt_logprobs": st.integers(0, 3), "token_relay": st.sampled_from(RELAY_MODES),
    "disaggregated_params": st.fixed_dictionaries({   # a worker serves it; the orchestrator: 400
        "request_type": st.just("context_only"), "token_relay": st.sampled_from(RELAY_MODES)}),
}
FIELDS = {
    COMPLETIONS: {**COMMON, "max_tokens": st.integers(1, 4), "logprobs": st.integers(0, 5),
                  "echo": st.booleans(),
                  "prompt": st.one_of(WORDS, VOCAB_IDS, st.lists(WORDS, min_size=1, max_size=2))},
    CHAT: {**COMMON, "messages": st.lists(MESSAGE, min_size=1, max_size=3),
           "max_tokens": st.integers(1, 4), "max_completion_tokens": st.integers(1, 4),
           "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
           "add_generation_prompt": st.booleans(),
           "chat_template_kwargs": st.dictionaries(st.sampled_from(
               ["enable_thinking", "add_generation_prompt", "messages", "bos_token", "tools"]),
               JSON, max_size=3)},
}
# Every other field name either endpoint knows, and some nobody does: for odd values.
OTHER_FIELDS = ["suffix", "best_of", "echo", "max_completion_tokens", "messages", "prompt",
                "top_logprobs", "chat_template_kwargs", "x", ""]
ODD = st.one_of(JSON, EXTREME_INTS, FLOATS, TEXT, st.just(RAW), TOKEN_IDS,
                NESTING.map(lambda d: json.loads("[" * d + "]" * d)),
                st.lists(MESSAGE, max_size=2), st.dictionaries(TEXT, EXTREME_INTS, max_size=3))


@st.composite
def json_bodies(draw, path: str) -> bytes:
    """A plausible request (its required field and a few others), then 0-3 fields set to odd
    values: wrong types, extremes, nesting, literals JSON has no room for."""
    fields = FIELDS[path]
    required = "prompt" if path == COMPLETIONS else "messages"
    names = draw(st.lists(st.sampled_from(sorted(fields)), max_size=10, unique=True))
    body = {name: draw(fields[name]) for name in [required, "max_tokens", *names]}
    for name in draw(st.lists(st.sampled_from(sorted(fields) + OTHER_FIELDS), max_size=3)):
        body[name] = draw(ODD)
    text = json.dumps(body)
    if RAW in text:
        text = text.replace(f'"{RAW}"', draw(st.sampled_from(RAW_LITERALS)), 1)
        text = text.replace(f'"{RAW}"', "0")
    return text.encode()


def bodies(path: str) -> st.SearchStrategy[bytes]:
    requests = json_bodies(path)
    return st.one_of(
        requests, requests, requests, requests, requests,           # most reach the engine
        JSON.map(lambda v: json.dumps(v).encode()),                 # any JSON value at all
        st.binary(max_size=200),                                    # not JSON
        st.tuples(requests, st.floats(0, 1)).map(lambda t: t[0][:int(len(t[0]) * t[1])]),
        st.sampled_from(RAW_LITERALS).map(str.encode),
    )


def send(url: str, path: str, body: bytes) -> tuple[int, bytes]:
    """POST on a fresh connection; raises if the server drops it without a whole response."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def fuzz(url: str, path: str) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies(path))
    def one(body: bytes) -> None:
        status, answer = send(url, path, body)
        assert status < 500 or status == 503, (status, answer[:500], body[:500])
    one()


NORMAL = {COMPLETIONS: {"prompt": "Hello there", "max_tokens": 3, "temperature": 0},
          CHAT: {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                 "temperature": 0}}


def assert_serves(url: str, path: str) -> None:
    status, body = post(url + path, NORMAL[path])
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert get(url + "/health")[0] == 200


REGRESSIONS = [   # (body, the parameter its 400 names) of requests that once did harm
    # made the generation worker's engine process exit (sibling seeds past 2^64)
    ({"prompt": "hi", "n": 2, "seed": 18446744073709551615, "max_tokens": 1}, "seed"),
    ({"prompt": "hi", "n": "2"}, "n"),                                # orchestrator: 500
    ({"messages": 5}, "prompt"),                                      # orchestrator: 500
    ({"prompt": "hi", "user": json.loads("[" * 300 + "]" * 300)}, None),   # orchestrator: 500
    ({"prompt": "hi", "max_tokens": 1, "stream": True, "stream_options": [1]},   # 500 when
     "stream_options"),                                               # CTX ended the request
    ({"prompt": "hi", "max_tokens": 1, "stream": "yes"}, "stream"),   # SSE, not a 400
]


@pytest.fixture(scope="module")
def worker():
    w = Worker(*MODEL)
    yield w
    w.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ctx = Worker(*MODEL, "--role", "ctx")
    gen = Worker(*MODEL, "--role", "gen")
    try:
        orch = Orchestrator(tmp_path_factory.mktemp("orch"), [ctx.url], [gen.url])
    except BaseException:
        ctx.close()
        gen.close()
        raise
    yield ctx, gen, orch
    for p in (orch, gen, ctx):
        p.close()


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_worker_answers_whatever_it_is_sent(worker, path):
    pid = engine_pid(worker)
    fuzz(worker.url, path)
    assert_serves(worker.url, path)
    assert alive(pid) and engine_pid(worker) == pid   # the same engine process throughout


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, "/tokenize", "/detokenize"])
def test_nesting_past_the_parsers_recursion_is_a_400(worker, path):
    """msgspec parses nesting recursively and raises RecursionError at about 1,000 levels
    (it was a 500 with a traceback logged, for every such request)."""
    for depth in (1000, 5000, 200_000):
        for body in (b'{"prompt": "hi", "max_tokens": 1, "user": ' + nested(depth) + b"}",
                     b'{"prompt": "hi", "x": ' + nested(depth) + b"}",
                     b'{"messages": ' + nested(depth) + b"}", b'{"prompt": ' + nested(depth) + b"}",
                     nested(depth)):
            status, answer = send(worker.url, path, body)
            assert status == 400, (path, depth, answer[:300])
            assert json.loads(answer)["error"]["type"] == "invalid_request_error"
    assert_serves(worker.url, COMPLETIONS)


@pytest.mark.parametrize("path,field", [(COMPLETIONS, "prompt"), (CHAT, "messages"),
                                        ("/tokenize", "prompt"), ("/tokenize", "messages")])
def test_a_text_past_the_context_is_refused_before_it_is_encoded(worker, path, field):
    """64 tokens of at most 81 characters each: a longer text is a 400 naming its length,
    without being encoded (~150x its size in memory: a 64 MiB body was ~9 GB)."""
    for size in (64 * 81 + 1, 10_000_000):
        text = "x" * size
        prompt = text if path == "/tokenize" else ["hi", text]
        body = {"prompt": prompt} if field == "prompt" else {
            "messages": [{"role": "user", "content": text}]}
        status, answer = send(worker.url, path, json.dumps({**body, "max_tokens": 1}).encode())
        error = json.loads(answer)["error"]
        assert status == 400 and error["param"] == field, answer[:300]
        assert f"the prompt is {len(text):,} characters" in error["message"] or \
            field == "messages", error       # (the chat template adds its own)
        assert "maximum context length of 64 tokens" in error["message"], error
    assert_serves(worker.url, path if path != "/tokenize" else COMPLETIONS)


@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
def test_more_messages_than_the_context_has_tokens_are_not_rendered(worker, path):
    for count in (65, 200_000):
        body = {"messages": [{"role": "user", "content": ""}] * count, "max_tokens": 1}
        status, answer = send(worker.url, path, json.dumps(body).encode())
        error = json.loads(answer)["error"]
        assert status == 400 and error["param"] == "messages", answer[:300]
        assert error["message"] == (f"{count:,} messages cannot fit in this model's maximum "
                                    f"context length of 64 tokens"), error
    assert_serves(worker.url, CHAT)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_cluster_answers_whatever_it_is_sent(cluster, path):
    ctx, gen, orch = cluster
    pids = [engine_pid(ctx), engine_pid(gen)]
    for body, param in REGRESSIONS:
        status, answer = send(orch.url, COMPLETIONS, json.dumps(body).encode())
        assert status == 400 and json.loads(answer)["error"]["param"] == param, answer
    fuzz(orch.url, path)
    assert_serves(orch.url, path)
    for w, pid in zip((ctx, gen), pids):
        assert get(w.url + "/health")[0] == 200 and engine_pid(w) == pid
