"""tools and tool_choice as a worker and the orchestrator read them: every bad input a 400
naming its field, the same from both (the orchestrator's before any worker sees it); the
grammar required and named ask for; tool calls shaped as OpenAI answers carry them."""

import json

import msgspec
import pytest

from splitserve.errors import InvalidRequestError
from splitserve.grammar_compile import GrammarCompiler
from splitserve.orchestrator import relay
from splitserve.protocol.engine import CompletionDelta
from splitserve.protocol.openai import decode_chat_request
from splitserve.protocol.openai_fields import UnknownFields
from splitserve.protocol.openai_responses import ResponseAccumulator, StreamEncoder
from splitserve.protocol.tool_parsers import get_parser
from splitserve.protocol.tools import MAX_SCHEMA_DEPTH, MAX_TOOLS, with_tools

USER = [{"role": "user", "content": "Weather in Paris?"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
NOW = {"type": "function", "function": {"name": "now"}}
HERMES = get_parser("hermes")


def nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def tool(**function) -> dict:
    return {"type": "function", "function": {"name": "f", **function}}


BAD = [
    ({"tools": "notalist"}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [WEATHER, {"type": "function"}]}, "tools[1].function"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0].function.name"),
    ({"tools": [tool(name="has space")]}, "tools[0].function.name"),
    ({"tools": [tool(parameters="an object")]}, "tools[0].function.parameters"),
    ({"tools": [tool(parameters=nested(MAX_SCHEMA_DEPTH + 5))]}, "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [tool(name=f"f{i}") for i in range(10_000)]}, "tools"),
    ({"tools": [tool(name=f"f{i}", description="x" * 4000) for i in range(100)]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
]


@pytest.mark.parametrize("extra, param", BAD)
def test_bad_tools_are_the_same_400_from_a_worker_and_the_orchestrator(extra, param):
    body = {"messages": USER, **extra}
    with pytest.raises(InvalidRequestError) as worker:
        decode_chat_request(json.dumps(body).encode())
    with pytest.raises(InvalidRequestError) as orch:
        relay.check_fields(relay.parse_body(json.dumps(body).encode()), True,
                           UnknownFields("orch"))
    assert worker.value.param == param, worker.value.message
    assert orch.value.param == param, orch.value.message


def test_a_schema_nested_10000_deep_is_refused_before_anything_walks_it():
    deep = '{"type": "array", "items": ' * 10_000 + '{"type": "string"}' + "}" * 10_000
    body = (json.dumps({"messages": USER})[:-1] + ', "tools": [{"type": "function", '
            '"function": {"name": "f", "parameters": ' + deep + "}}]}").encode()
    for decode in (decode_chat_request, relay.parse_body):
        with pytest.raises(InvalidRequestError):
            decode(body)


def test_the_bounds_admit_what_they_say():
    tools = [tool(name=f"f{i}", parameters=nested(MAX_SCHEMA_DEPTH - 1))
             for i in range(MAX_TOOLS)]
    req = decode_chat_request(json.dumps({"messages": USER, "tools": tools}).encode())
    assert len(req.tools) == MAX_TOOLS and req.tool_mode == "auto"


def request(**extra):
    return decode_chat_request(json.dumps({"messages": USER, **extra}).encode())


def test_tool_choice_modes_and_their_grammar():
    assert request(tools=[WEATHER]).tool_mode == "auto"          # OpenAI's default
    assert request(tool_choice="required").tool_mode == "none"   # no tools: none (vLLM)
    for choice, grammar in [("none", False), ("auto", False), ("required", True),
                            ({"type": "function", "function": {"name": "now"}}, True)]:
        req = request(tools=[WEATHER, NOW], tool_choice=choice)
        params, schemas = with_tools(req, req.sampling_params(), HERMES)
        assert (params.grammar is not None) == grammar, choice
        assert [s.field for s in schemas] == ([] if choice == "none" else
                                              ["tools[0].function.parameters"])
    req = request(tools=[WEATHER, NOW], tool_choice={"type": "function",
                                                      "function": {"name": "now"}},
                  parallel_tool_calls=False)
    params, _ = with_tools(req, req.sampling_params(), HERMES)
    assert '"now"' in params.grammar.source and "get_weather" not in params.grammar.source
    assert params.grammar.source.startswith("start: call\n") and params.grammar.field == "tools"
    req = request(tools=[WEATHER], tool_choice="required",
                  response_format={"type": "json_object"})
    with pytest.raises(InvalidRequestError) as err:
        with_tools(req, req.sampling_params(), HERMES)
    assert err.value.param == "tool_choice"


def test_a_schema_that_does_not_compile_names_its_tool(tiny_source):
    tok = tiny_source.tokenizer
    compiler = GrammarCompiler(tok.to_json(), tok.vocab_size, tok.eos_token_ids)
    bad = tool(name="g", parameters={"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["n"]})
    req = request(tools=[WEATHER, bad], tool_choice="auto")
    _, schemas = with_tools(req, req.sampling_params(), HERMES)
    compiler.check(schemas[0])
    with pytest.raises(InvalidRequestError) as err:
        compiler.check(schemas[1])
    assert err.value.param == "tools[1].function.parameters"


ANSWER = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
          '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')


def deltas(text: str, pieces: int):
    step = -(-len(text) // pieces)
    parts = [text[i:i + step] for i in range(0, len(text), step)]
    return [CompletionDelta("r", 0, [1], p, finish_reason=0 if i == len(parts) - 1 else None,
                            num_prompt_tokens=5 if i == 0 else 0) for i, p in enumerate(parts)]


def test_whole_answer_tool_calls():
    acc = ResponseAccumulator(request(tools=[WEATHER, NOW]), "m", tool_parser=HERMES)
    for d in deltas(ANSWER, 1):
        acc.add(d)
    (choice,) = msgspec.json.decode(acc.body())["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert len({c["id"] for c in calls}) == 2


def test_streamed_tool_calls_as_openai_sends_them():
    enc = StreamEncoder(request(tools=[WEATHER, NOW], stream=True), "m", tool_parser=HERMES)
    events = [json.loads(e[len(b"data: "):]) for d in deltas(ANSWER, 7)
              for e in enc.chunk(d).split(b"\n\n") if e]
    choices = [e["choices"][0] for e in events]
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    assert choices[-1]["finish_reason"] == "tool_calls" and choices[-1]["delta"] == {}
    calls = {}
    for c in choices:
        for part in c["delta"].get("tool_calls", ()):
            call = calls.setdefault(part["index"], {"name": None, "arguments": ""})
            if "id" in part:
                assert part["id"].startswith("call_") and part["type"] == "function"
                call["name"] = part["function"]["name"]
            call["arguments"] += part["function"]["arguments"]
    assert calls == {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                     1: {"name": "now", "arguments": "{}"}}
    assert not any(c["delta"].get("content") for c in choices[1:])


def test_streamed_tool_calls_keep_every_tokens_logprobs():
    from splitserve.protocol.engine import Logprob
    req = request(tools=[WEATHER, NOW], stream=True, logprobs=True, top_logprobs=1)
    enc = StreamEncoder(req, "m", tool_parser=HERMES, token_text=str)
    sent = deltas(ANSWER, 5)
    for i, d in enumerate(sent):
        d.logprobs = [Logprob(i, -0.5, 1, [(i, -0.5)])]
    events = [json.loads(e[len(b"data: "):]) for d in sent
              for e in enc.chunk(d).split(b"\n\n") if e]
    tokens = [entry["token"] for e in events for c in e["choices"]
              if c["logprobs"] for entry in c["logprobs"]["content"]]
    assert tokens == [str(i) for i in range(len(sent))]


def test_the_parser_flag_on_serve_and_up():
    from splitserve.cli import build_parser, server_config
    from splitserve.orchestrator.up import worker_command
    from splitserve.placement import WorkerPlan
    serve = server_config(build_parser().parse_args(["serve", "--tool-call-parser", "mistral"]))
    assert serve.tool_call_parser == "mistral"
    assert server_config(build_parser().parse_args(["serve"])).tool_call_parser is None
    up = build_parser().parse_args(["up", "--tool-call-parser", "llama3_json"])
    cmd = worker_command(up, "gen", 8001, WorkerPlan((0,), 1, (0,)))
    assert cmd[cmd.index("--tool-call-parser") + 1] == "llama3_json"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "pythonic"])


@pytest.mark.parametrize("cut", [5, 40, len(ANSWER) // 2, 95])
def test_a_stream_continued_mid_call_reads_its_calls_on_from_the_text_so_far(cut):
    """A stream moved to another worker at any point (a GEN drained or died mid-call): the
    second worker's encoder is given the text already sent and parses on from there, so the
    client sees the same calls, numbered on, and no text twice."""
    def events(enc, parts):
        return [json.loads(e[len(b"data: "):]) for d in parts
                for e in enc.chunk(d).split(b"\n\n") if e]
    req = request(tools=[WEATHER, NOW], stream=True)
    head = [CompletionDelta("r", 0, [1], ANSWER[:cut], num_prompt_tokens=5)]
    tail = [CompletionDelta("r", 0, [1], ANSWER[cut:], finish_reason=0)]
    first = events(StreamEncoder(req, "m", tool_parser=HERMES), head)
    second = events(StreamEncoder(req, "m", tool_parser=HERMES, tool_prefix=ANSWER[:cut]), tail)
    choices = [e["choices"][0] for e in first + second[1:]]     # the role chunk once
    calls = {}
    for c in choices:
        for part in c["delta"].get("tool_calls", ()):
            call = calls.setdefault(part["index"], {"name": None, "arguments": ""})
            if "id" in part:
                assert call["name"] is None
                call["name"] = part["function"]["name"]
            call["arguments"] += part["function"]["arguments"]
    assert calls == {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                     1: {"name": "now", "arguments": "{}"}}
    assert not any(c["delta"].get("content") for c in choices[1:])
    assert choices[-1]["finish_reason"] == "tool_calls"
