"""The disaggregated path with real processes: orchestrator -> CTX worker -> GEN worker,
KV pulled over TCP, on the tiny model (float32 so greedy output is exact)."""

import json
import time

import openai
import pytest

from server_utils import Orchestrator, Worker, metrics, post, stream

MODEL = ("--model", "tiny-random", "--dtype", "float32")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ctx = Worker(*MODEL, "--role", "ctx", "--kv-lease-seconds", "3")
    gen = Worker(*MODEL, "--role", "gen", "--kv-timeout", "2")
    orch = Orchestrator(tmp_path_factory.mktemp("orch"), [ctx.url], [gen.url])
    yield ctx, gen, orch
    for p in (orch, gen, ctx):
        p.close()


def leased(worker) -> float:
    return metrics(worker.url)["splitserve_kv_blocks_leased"]


COMPLETION = {"model": "tiny-random", "prompt": "The quick brown fox jumps", "max_tokens": 12,
              "temperature": 0}
CHAT = {"model": "tiny-random", "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 12, "temperature": 0}


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION),
                                        ("/v1/chat/completions", CHAT)])
def test_disaggregated_equals_aggregated(cluster, path, body):
    ctx, gen, orch = cluster
    _, want = post(gen.url + path, body)            # aggregated on one worker
    status, got = post(orch.url + path, body)
    assert status == 200
    key = "text" if "prompt" in body else "message"
    assert got["choices"][0][key] == want["choices"][0][key]
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]   # the real length
    events = stream(orch.url + path, {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    if key == "text":
        text = "".join(c["text"] for e in events[:-2] for c in e["choices"])
    else:
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2])
        want["choices"][0]["text"] = want["choices"][0]["message"]["content"]
    assert text == want["choices"][0]["text"]
    assert leased(ctx) == 0
    ctx_m = metrics(ctx.url)
    assert ctx_m["splitserve_prefill_seconds_count"] >= 2
    assert ctx_m["splitserve_request_queue_time_seconds_count"] >= 2
    gen_m = metrics(gen.url)
    assert gen_m["splitserve_kv_transfer_seconds_count"] >= 2
    assert gen_m["splitserve_gen_preprocessing_seconds_count"] >= 2


def test_request_fields_hold_through_the_split(cluster):
    """continue_final_message, chat echo and continuous usage: the disaggregated answer is
    the aggregated one; a refused field is the same 400 from the orchestrator."""
    ctx, gen, orch = cluster
    path = "/v1/chat/completions"
    body = {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "Once"}],
            "continue_final_message": True, "add_generation_prompt": False, "echo": True}
    _, want = post(gen.url + path, body)
    status, got = post(orch.url + path, body)
    assert status == 200 and got["choices"][0]["message"] == want["choices"][0]["message"]
    content = want["choices"][0]["message"]["content"]
    assert content.startswith("Once") and len(content) > len("Once")
    options = {"include_usage": True, "continuous_usage_stats": True}
    for max_tokens in (12, 1):      # GEN streams; CTX ends the request (the orchestrator's SSE)
        events = stream(orch.url + path, {**body, "max_tokens": max_tokens,
                                          "stream_options": options})
        assert events[-1] == "[DONE]" and all("usage" in e for e in events[:-1])
        text = "".join(c["delta"].get("content") or "" for e in events[:-1]
                       for c in e["choices"])
        assert text.startswith("Once") and (max_tokens == 1 or text == content)
    for refused in ({"guided_decoding_backend": "xgrammar"},
                    {"chat_template": "{{ messages }}"}):   # not trusted by these workers
        answers = [post(url + path, {**CHAT, **refused}) for url in (orch.url, gen.url)]
        assert answers[0] == answers[1] and answers[0][0] == 400
        assert answers[0][1]["error"]["param"] == next(iter(refused))


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
          "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def _satisfies(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9


def test_structured_output_through_the_split(cluster):
    """json_schema with the official client (whole, streamed, sampled); greedy under a
    grammar, disaggregated == aggregated for every relay mode; a bad grammar is a 400."""
    ctx, gen, orch = cluster
    client = openai.OpenAI(base_url=orch.url + "/v1", api_key="none", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}
    ask = dict(model="tiny-random", messages=CHAT["messages"], max_tokens=40,
               response_format=fmt)
    answer = client.chat.completions.create(temperature=0, **ask)
    assert _satisfies(answer.choices[0].message.content)
    assert answer.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(temperature=1.0, seed=3, stream=True, **ask)
    assert _satisfies("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    body = {**CHAT, "max_tokens": 40, "response_format": fmt}
    _, want = post(gen.url + "/v1/chat/completions", body)
    for relay in ("list", "b64", "metadata"):
        status, got = post(orch.url + "/v1/chat/completions", {**body, "token_relay": relay})
        assert status == 200 and got["choices"][0] == want["choices"][0], relay
    for bad, param in [({"response_format": {"type": "bogus"}}, "response_format"),
                       ({"guided_regex": "(a"}, "guided_regex"),
                       ({"guided_json": {"type": "string", "minLength": 3, "maxLength": 1}},
                        "guided_json")]:
        for url in (orch.url, gen.url):
            status, err = post(url + "/v1/chat/completions", {**CHAT, **bad})
            assert status == 400 and err["error"]["param"] == param, (url, err)
    status, after = post(orch.url + "/v1/chat/completions", body)
    assert status == 200 and after["choices"][0] == want["choices"][0]   # serving on
    assert leased(ctx) == 0


def test_context_worker_finishes_short_requests(cluster):
    ctx, gen, orch = cluster
    before = metrics(gen.url)["splitserve_kv_transfer_seconds_count"]
    status, got = post(orch.url + "/v1/completions", {**COMPLETION, "max_tokens": 1})
    assert status == 200 and got["choices"][0]["finish_reason"] == "length"
    assert "disaggregated_params" not in got
    events = stream(orch.url + "/v1/completions", {**COMPLETION, "max_tokens": 1})
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["finish_reason"] == "length"
    assert metrics(gen.url)["splitserve_kv_transfer_seconds_count"] == before
    assert leased(ctx) == 0


def test_n_greater_than_one_runs_aggregated_on_a_generation_worker(cluster):
    _, gen, orch = cluster
    status, got = post(orch.url + "/v1/completions", {**COMPLETION, "n": 2})
    assert status == 200 and len(got["choices"]) == 2
    assert got["choices"][0]["text"] == got["choices"][1]["text"]


def ctx_answer(ctx, body=COMPLETION):
    status, ans = post(ctx.url + "/v1/completions",
                       {**body, "disaggregated_params": {"request_type": "context_only"}})
    assert status == 200
    return ans["disaggregated_params"]


def generation(gen, params, body=COMPLETION):
    return post(gen.url + "/v1/completions",
                {**body, "disaggregated_params": {**params, "request_type": "generation_only"}})


def test_bad_disaggregated_params_get_clear_errors(cluster):
    ctx, gen, _ = cluster
    params = ctx_answer(ctx)
    n = params["prompt_len"]
    cases = [
        ({**params, "prompt_len": n + 1}, "disaggregated_params.prompt_len"),
        ({**params, "prompt_len": -1}, "disaggregated_params.prompt_len"),
        ({k: v for k, v in params.items() if k != "kv_handle"}, "disaggregated_params.kv_handle"),
        ({**params, "kv_handle": {**params["kv_handle"], "layout": "forged"}},
         "disaggregated_params.kv_handle"),
        ({**params, "kv_handle": {**params["kv_handle"], "num_tokens": n + 3}},
         "disaggregated_params.prompt_len"),
    ]
    for bad, param in cases:
        status, err = generation(gen, bad)
        assert status == 400, (bad, err)
        assert err["error"]["param"] == param
    # Well-formed but unknown to the CTX: a clean server error, nothing leaked.
    forged = {**params, "kv_handle": {**params["kv_handle"], "ctx_request_id": "cmpl-forged"}}
    status, err = generation(gen, forged)
    assert status == 500 and "unknown or expired" in err["error"]["message"]
    # The real handle still works once, then is gone.
    status, ok = generation(gen, params)
    assert status == 200 and ok["usage"]["completion_tokens"] == 12
    status, again = generation(gen, params)
    assert status == 500 and "unknown or expired" in again["error"]["message"]
    assert metrics(gen.url)["splitserve_kv_blocks_used"] == 0
    assert leased(ctx) == 0


def test_unreachable_context_worker(cluster):
    ctx, gen, _ = cluster
    params = ctx_answer(ctx)
    dead = {**params, "kv_handle": {**params["kv_handle"], "endpoint": "tcp://127.0.0.1:9"}}
    status, err = generation(gen, dead)
    assert status == 500 and "could not connect" in err["error"]["message"]
    assert metrics(gen.url)["splitserve_kv_blocks_used"] == 0
    wait_for(lambda: leased(ctx) == 0, 10)   # the CTX lease expires on its own


def wait_for(cond, timeout):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


def test_nixl_backend_end_to_end(tmp_path):
    pytest.importorskip("nixl", exc_type=ImportError,
                        reason="nixl not importable: install torch first, then `pip install nixl`")
    ctx = Worker(*MODEL, "--role", "ctx", "--kv-backend", "nixl")
    gen = Worker(*MODEL, "--role", "gen", "--kv-backend", "nixl")
    orch = Orchestrator(tmp_path, [ctx.url], [gen.url])
    try:
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            _, want = post(gen.url + path, body)
            status, got = post(orch.url + path, body)
            assert status == 200 and got["choices"][0] == want["choices"][0]
        assert metrics(gen.url)["splitserve_kv_transfer_seconds_count"] == 2
        wait_for(lambda: leased(ctx) == 0, 5)
    finally:
        for p in (orch, gen, ctx):
            p.close()
