"""Tool calling through `splitserve up` (tiny-random, float32: greedy is exact) with the
official openai client: required and named give tool_calls whose arguments parse and
satisfy the schema, whole and streamed, finish_reason tool_calls; disaggregated equals
aggregated for every relay mode; auto parses a call the answer carries; bad tools are a
400 naming the field, and the cluster serves on."""

import json

import openai
import pytest

from server_utils import get, logged_up, post
from tool_utils import TOOLS, satisfied

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
PATH = "/v1/chat/completions"


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    yield from logged_up(tmp_path_factory, "tools")


def test_required_and_named_whole_and_streamed_with_the_openai_client(up):
    cluster, log = up
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0)
    ask = dict(model="tiny-random", messages=USER, tools=TOOLS, max_tokens=60,
               parallel_tool_calls=False)
    for choice in ("required", NAMED):
        answer = client.chat.completions.create(tool_choice=choice, temperature=0, **ask)
        c = answer.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, answer
        (call,) = c.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        assert satisfied(call.function.name, call.function.arguments)
        if choice is NAMED:
            assert call.function.name == "get_weather"
        chunks = list(client.chat.completions.create(tool_choice=choice, temperature=1.0,
                                                     seed=4, stream=True, **ask))
        parts = [t for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or ()]
        assert parts[0].id.startswith("call_") and parts[0].function.name
        arguments = "".join(p.function.arguments or "" for p in parts)
        assert satisfied(parts[0].function.name, arguments)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "tool calls: hermes parser; the model's chat template ignores tools" in \
        log.read_text()


def calls_without_ids(answer: dict) -> list:
    message = answer["choices"][0]["message"]
    return [c["function"] for c in message.get("tool_calls") or ()], message["content"]


def test_disaggregated_equals_aggregated_for_every_relay_mode(up):
    cluster, _ = up
    gen = json.loads(get(cluster.url + "/health")[1])["healthy"]["gen"][0]
    for choice in ("required", NAMED):
        body = {"model": "tiny-random", "messages": USER, "tools": TOOLS, "max_tokens": 60,
                "temperature": 0, "tool_choice": choice, "parallel_tool_calls": False}
        status, want = post(gen + PATH, body)                 # aggregated on one worker
        assert status == 200 and want["choices"][0]["finish_reason"] == "tool_calls", want
        for relay in ("list", "b64", "metadata"):
            status, got = post(cluster.url + PATH, {**body, "token_relay": relay})
            assert status == 200 and calls_without_ids(got) == calls_without_ids(want), relay
            assert got["usage"] == want["usage"]


def test_auto_parses_the_call_an_answer_carries_whole_and_streamed(up):
    """The answer goes on from an assistant turn that holds a call (echo shows it): auto
    turns it into tool_calls, through the split and when the CTX ends the request."""
    cluster, _ = up
    call = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    body = {"model": "tiny-random", "tools": TOOLS, "temperature": 0, "echo": True,
            "messages": [*USER, {"role": "assistant", "content": call}],
            "add_generation_prompt": False, "continue_final_message": True}
    for max_tokens in (1, 4):        # 1: the CTX answers alone (the orchestrator's stream)
        status, answer = post(cluster.url + PATH, {**body, "max_tokens": max_tokens})
        message = answer["choices"][0]["message"]
        assert status == 200 and [c["function"] for c in message["tool_calls"]] == [
            {"name": "now", "arguments": "{}"}], answer
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0)
        chunks = list(client.chat.completions.create(
            stream=True, max_tokens=max_tokens, **{k: v for k, v in body.items()
                                                    if k not in ("echo", "add_generation_prompt",
                                                                 "continue_final_message")},
            extra_body={k: body[k] for k in ("echo", "add_generation_prompt",
                                             "continue_final_message")}))
        parts = [t for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or ()]
        assert parts[0].function.name == "now"
        assert "".join(p.function.arguments or "" for p in parts) == "{}"


def test_bad_tools_are_400s_and_the_cluster_serves_on(up):
    cluster, _ = up
    body = {"model": "tiny-random", "messages": USER, "max_tokens": 4}
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 5,
                                               "maximum": 1}}, "required": ["n"]}}}]
    for extra, param in [({"tools": "notalist"}, "tools"),
                         ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
                         ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {
                             "name": "nope"}}}, "tool_choice.function.name"),
                         ({"tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                     for i in range(10_000)]}, "tools"),
                         ({"tools": bad_schema, "tool_choice": "required"},
                          "tools[0].function.parameters")]:
        status, err = post(cluster.url + PATH, {**body, **extra})
        assert status == 400 and err["error"]["param"] == param, (param, err)
    status, answer = post(cluster.url + PATH, {**body, "tools": TOOLS, "tool_choice": "required",
                                               "max_tokens": 60, "parallel_tool_calls": False})
    assert status == 200 and answer["choices"][0]["message"]["tool_calls"]
