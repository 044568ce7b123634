"""The orchestrator is the same API as a worker: a batch of prompts and n > 1 are split into
single-choice disaggregated requests and merged in order; /tokenize and /detokenize are
forwarded to a worker."""

import pytest

from server_utils import Orchestrator, Worker, call, post, stream

MODEL = ("--model", "tiny-random", "--dtype", "float32")
BATCH = {"model": "tiny-random", "prompt": ["The quick brown fox", "Once upon a time there",
                                            "A"], "max_tokens": 6, "temperature": 0}
SAMPLED = {"model": "tiny-random", "prompt": "Tell me a story", "max_tokens": 6, "n": 3,
           "temperature": 1.0, "seed": 1234}
CHAT = {"model": "tiny-random", "messages": [{"role": "user", "content": "Hi there"}],
        "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 7}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ctx = Worker(*MODEL, "--role", "ctx")
    gen = Worker(*MODEL, "--role", "gen")
    orch = Orchestrator(tmp_path_factory.mktemp("split"), [ctx.url], [gen.url])
    yield gen, orch
    for p in (orch, gen, ctx):
        p.close()


def texts(answer: dict) -> dict[int, str]:
    return {c["index"]: c["text"] if "text" in c else c["message"]["content"]
            for c in answer["choices"]}


def test_a_split_batch_answers_as_one_worker_does(cluster):
    gen, orch = cluster
    status, want = post(gen.url + "/v1/completions", BATCH)
    assert status == 200, want
    status, got = post(orch.url + "/v1/completions", BATCH)
    assert status == 200, got
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert texts(got) == texts(want)
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert got["usage"][k] == want["usage"][k], k
    assert [c["finish_reason"] for c in got["choices"]] == \
        [c["finish_reason"] for c in want["choices"]]


@pytest.mark.parametrize("path, body", [("/v1/completions", {**BATCH, "n": 2, "seed": 3,
                                                             "temperature": 0.8}),
                                        ("/v1/completions", SAMPLED),
                                        ("/v1/chat/completions", CHAT)])
def test_choice_j_of_n_samples_with_sibling_js_seed(cluster, path, body):
    """Each choice is the request alone (n = 1) with the seed a worker gives sibling j:
    seed + j. (A seeded request through the split is not yet the aggregated one token for
    token: the generation worker's generator does not continue the context worker's.)"""
    _, orch = cluster
    status, got = post(orch.url + path, body)
    assert status == 200, got
    n, prompts = body["n"], body.get("prompt", [None])
    prompts = prompts if isinstance(prompts, list) else [prompts]
    want, usage = {}, 0
    for p, prompt in enumerate(prompts):
        for j in range(n):
            one = {**body, "n": 1, "seed": body["seed"] + j}
            if prompt is not None:
                one["prompt"] = prompt
            _, alone = post(orch.url + path, one)
            want[p * n + j] = texts(alone)[0]
            usage += alone["usage"]["completion_tokens"]
    assert texts(got) == want
    assert got["usage"]["completion_tokens"] == usage


@pytest.mark.parametrize("path, body", [("/v1/completions", BATCH),
                                        ("/v1/completions", {**BATCH, "max_tokens": 1}),
                                        ("/v1/chat/completions", CHAT)])
def test_a_split_stream_carries_each_choice_under_its_index(cluster, path, body):
    """(max_tokens 1: each context worker ends its part, whose answer is made a stream.)"""
    _, orch = cluster
    _, want = post(orch.url + path, body)
    events = stream(orch.url + path, {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    *chunks, usage = events[:-1]
    got: dict[int, str] = {}
    for e in chunks:
        assert e["id"] == chunks[0]["id"]
        for c in e["choices"]:
            piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
            got[c["index"]] = got.get(c["index"], "") + piece
    assert got == texts(want)
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == \
        want["usage"]["total_tokens"]


def test_a_bad_field_of_a_split_request_is_one_400(cluster):
    _, orch = cluster
    status, body = post(orch.url + "/v1/completions", {**BATCH, "n": 1000})
    assert status == 400 and body["error"]["param"] == "n", body
    status, body = post(orch.url + "/v1/completions", {**BATCH, "temperature": "hot"})
    assert status == 400, body


def test_tokenize_and_detokenize_are_a_workers(cluster):
    gen, orch = cluster
    for path, body in (("/tokenize", {"prompt": "Hello world"}),
                       ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/detokenize", {"tokens": [1, 2, 3]})):
        assert post(orch.url + path, body) == post(gen.url + path, body)
    status, body = post(orch.url + "/detokenize", {"tokens": "x"})
    assert status == 400, body


def test_x_request_id_is_echoed_or_made(cluster):
    _, orch = cluster
    status, _, headers = call("POST", orch.url + "/tokenize", {"prompt": "x"},
                              {"X-Request-Id": "trace-42"})
    assert status == 200 and headers["X-Request-Id"] == "trace-42"
    for sent in ({}, {"X-Request-Id": "bad id\twith spaces"}, {"X-Request-Id": "x" * 129}):
        _, _, headers = call("GET", orch.url + "/version", headers=sent)
        made = headers["X-Request-Id"]
        assert made != sent.get("X-Request-Id") and len(made) == 32


def test_a_part_a_worker_refuses_fails_the_request_clearly(cluster):
    """A prompt of ids outside the vocabulary: a worker refuses the whole batch; through the
    split, the part's refusal is the answer (or, once other parts stream, an error event)."""
    gen, orch = cluster
    bad = {**BATCH, "prompt": [[1, 2, 3], [10**6]]}
    status, want = post(gen.url + "/v1/completions", bad)
    assert status == 400, want
    status, got = post(orch.url + "/v1/completions", bad)
    assert status == 400 and "vocabulary" in got["error"]["message"], got
    try:
        events = stream(orch.url + "/v1/completions", bad)
    except Exception as exc:      # refused before the stream's head: urllib's HTTPError
        assert getattr(exc, "code", None) == 400, exc
    else:
        assert "error" in events[-2] and events[-1] == "[DONE]", events
