"""Nothing a client sends is silently ignored: every field of OpenAI's and vLLM's completions
and chat schemas is implemented or refused with a 400 naming it, the same from a worker and
from the orchestrator; a field no schema knows is ignored with one warning per name."""

import asyncio
import json
import logging

import pytest

from splitserve.errors import InvalidRequestError
from splitserve.model.loader import load_model_source
from splitserve.orchestrator import relay
from splitserve.orchestrator.app import Orchestrator
from splitserve.orchestrator.cluster import ClusterConfig, PoolConfig
from splitserve.protocol.engine import CompletionDelta
from splitserve.protocol.openai import ResponseAccumulator, StreamEncoder
from splitserve.protocol.openai_fields import (
    CHAT, COMPLETIONS, FIELDS, IMPLEMENTED, REFUSED, UnknownFields, field_of)
from splitserve.protocol.openai_requests import decode_chat_request, decode_completion_request
from splitserve.protocol.prompts import chat_prompt

USER = [{"role": "user", "content": "hi"}]
BASE = {COMPLETIONS: {"prompt": "hi"}, CHAT: {"messages": USER}}
DECODE = {COMPLETIONS: decode_completion_request, CHAT: decode_chat_request}

# The request fields of OpenAI's API reference and of vLLM's protocol (0.10 to 0.11, with the
# older guided_* names), per endpoint.
OPENAI_COMPLETIONS = ("model prompt best_of echo frequency_penalty logit_bias logprobs "
                      "max_tokens n presence_penalty seed stop stream stream_options suffix "
                      "temperature top_p user")
OPENAI_CHAT = ("messages model audio frequency_penalty function_call functions logit_bias "
               "logprobs max_completion_tokens max_tokens metadata modalities n "
               "parallel_tool_calls prediction presence_penalty prompt_cache_key "
               "reasoning_effort response_format safety_identifier seed service_tier stop "
               "store stream stream_options temperature tool_choice tools top_logprobs top_p "
               "user verbosity web_search_options")
VLLM_SAMPLING = ("use_beam_search top_k min_p repetition_penalty length_penalty "
                 "stop_token_ids include_stop_str_in_output ignore_eos min_tokens "
                 "skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens "
                 "allowed_token_ids prompt_logprobs")
VLLM_BOTH = ("response_format structured_outputs guided_json guided_regex guided_choice "
             "guided_grammar guided_decoding_backend guided_whitespace_pattern priority "
             "request_id logits_processors return_tokens_as_token_ids return_token_ids "
             "cache_salt kv_transfer_params vllm_xargs repetition_detection "
             "add_special_tokens")
VLLM_COMPLETIONS = "prompt_embeds"
VLLM_CHAT = ("bad_words echo add_generation_prompt continue_final_message documents "
             "chat_template chat_template_kwargs mm_processor_kwargs media_io_kwargs "
             "structural_tag include_reasoning max_repetition_pattern_size "
             "min_repetition_pattern_size repetition_min_count best_of")
SCHEMAS = {
    COMPLETIONS: f"{OPENAI_COMPLETIONS} {VLLM_SAMPLING} {VLLM_BOTH} {VLLM_COMPLETIONS}".split(),
    CHAT: f"{OPENAI_CHAT} {VLLM_SAMPLING} {VLLM_BOTH} {VLLM_CHAT}".split(),
}

# For each refused field: a value asking for what is not done, and one asking for nothing.
REFUSED_VALUES = {
    "suffix": ("tail", ""),
    "functions": ([{"name": "f"}], []),
    "function_call": ("auto", "none"),
    "modalities": (["text", "audio"], ["text"]),
    "store": (True, False),
    "metadata": ({"a": "b"}, {}),
    "service_tier": ("flex", "auto"),
    "use_beam_search": (True, False),
    "length_penalty": (0.5, 1.0),
    "allowed_token_ids": ([1, 2], []),
    "bad_words": (["no"], []),
    "max_repetition_pattern_size": (4, 0),
    "min_repetition_pattern_size": (4, 0),
    "repetition_min_count": (3, 0),
    "priority": (5, 0),
    "guided_decoding_backend": ("xgrammar", "llguidance"),
    "return_tokens_as_token_ids": (True, False),
    "return_token_ids": (True, False),
    "include_reasoning": (False, True),
}


def refused_value(name):
    return REFUSED_VALUES.get(name, ({"x": 1},))[0]


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_every_schema_field_is_known_implemented_or_refused(endpoint):
    missing = [n for n in SCHEMAS[endpoint] if field_of(n, endpoint) is None]
    assert not missing, missing
    assert all(f.status in (IMPLEMENTED, REFUSED) and f.what for f in FIELDS.values())


def _refused(endpoint):
    return [(endpoint, n) for n in FIELDS if (f := field_of(n, endpoint)) and f.status == REFUSED]


@pytest.mark.parametrize("endpoint, name", _refused(COMPLETIONS) + _refused(CHAT))
def test_a_refused_field_is_a_400_naming_it_on_a_worker_and_the_orchestrator(endpoint, name):
    body = {**BASE[endpoint], name: refused_value(name)}
    with pytest.raises(InvalidRequestError) as worker:
        DECODE[endpoint](json.dumps(body).encode())
    with pytest.raises(InvalidRequestError) as orch:
        relay.check_fields(body, endpoint == CHAT, UnknownFields("orch"))
    assert worker.value.param == orch.value.param == name
    assert worker.value.message == orch.value.message and "not supported" in orch.value.message


@pytest.mark.parametrize("name", [n for n in REFUSED_VALUES if len(REFUSED_VALUES[n]) > 1])
def test_a_refused_field_asking_for_nothing_is_accepted(name):
    endpoint = CHAT if field_of(name, CHAT) else COMPLETIONS
    body = {**BASE[endpoint], name: REFUSED_VALUES[name][1], "priority": 0}
    DECODE[endpoint](json.dumps(body).encode())
    relay.check_fields(body, endpoint == CHAT, UnknownFields("orch"))


def test_bad_response_formats_and_tools_are_refused_honestly():
    for extra, param in [({"response_format": {"type": "json_schema", "json_schema": {}}},
                          "response_format.json_schema"),
                         ({"response_format": {"type": "bogus"}}, "response_format"),
                         ({"response_format": "text"}, "response_format"),
                         ({"tools": "notalist"}, "tools"),
                         ({"tools": "notalist", "tool_choice": "none"}, "tools"),
                         ({"tools": [{"type": "function", "function": {"name": "f"}}],
                           "tool_choice": {"type": "function", "function": {"name": "g"}}},
                          "tool_choice.function.name")]:
        with pytest.raises(InvalidRequestError) as err:
            decode_chat_request(json.dumps({"messages": USER, **extra}).encode())
        assert err.value.param == param, extra


def test_tools_under_tool_choice_none_reach_the_template():
    tok = load_model_source("tiny-random").tokenizer.replace(
        chat_template="{% for t in tools %}{{ t.function.name }};{% endfor %}"
                      "{{ messages[-1].content }}")
    req = decode_chat_request(json.dumps({"messages": USER, "tool_choice": "none", "tools": [
        {"type": "function", "function": {"name": "lookup", "parameters": {}}}]}).encode())
    assert chat_prompt(tok, req, 4096)[0] == "lookup;hi"


def test_unknown_fields_are_warned_once_per_name_and_bounded(caplog):
    unknown = UnknownFields("test", limit=3)
    body = json.dumps({"prompt": "hi", "frobnicate": 1, "max_tokens": 2}).encode()
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert decode_completion_request(body, unknown).max_tokens == 2
        decode_completion_request(json.dumps({"prompt": "hi"}).encode(), unknown)
    assert [r.getMessage().count("'frobnicate'") for r in caplog.records] == [1]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        for i in range(10):
            decode_chat_request(json.dumps({"messages": USER, f"x{i}": 1}).encode(), unknown)
    assert len(caplog.records) == 3 and "no more" in caplog.records[-1].getMessage()
    assert len(unknown.seen) == 3


def test_a_bad_field_next_to_an_unknown_one_is_still_named():
    with pytest.raises(InvalidRequestError) as err:
        decode_completion_request(json.dumps({"prompt": "hi", "zzz": 1, "n": "x"}).encode(),
                                  UnknownFields("test"))
    assert err.value.param == "n"


def _tok():
    return load_model_source("tiny-random").tokenizer


def test_continue_final_message_leaves_the_last_message_open():
    messages = [*USER, {"role": "assistant", "content": "The answer is"}]
    with pytest.raises(InvalidRequestError) as err:   # add_generation_prompt is true by default
        decode_chat_request(json.dumps({"messages": messages,
                                        "continue_final_message": True}).encode())
    assert err.value.param == "continue_final_message"
    req = decode_chat_request(json.dumps({"messages": messages, "continue_final_message": True,
                                          "add_generation_prompt": False}).encode())
    text, ids = chat_prompt(_tok(), req, 4096)
    assert text.endswith("<|im_start|>assistant\nThe answer is"), text
    closed = decode_chat_request(json.dumps({"messages": messages,
                                             "add_generation_prompt": False}).encode())
    assert chat_prompt(_tok(), closed, 4096)[0].startswith(text) and len(ids) > 0


def test_add_special_tokens():
    tok = _tok().replace(add_bos=True, chat_template="{{ messages[-1].content }}")
    plain = decode_chat_request(json.dumps({"messages": USER}).encode())
    with_bos = decode_chat_request(json.dumps({"messages": USER,
                                               "add_special_tokens": True}).encode())
    a, b = chat_prompt(tok, plain, 4096)[1], chat_prompt(tok, with_bos, 4096)[1]
    assert b.tolist() == [tok.bos_token_id, *a.tolist()]
    assert decode_completion_request(b'{"prompt": "x"}').add_special_tokens
    assert not decode_completion_request(
        b'{"prompt": "x", "add_special_tokens": false}').add_special_tokens


def _delta(text, ids, finish=None, prompt_tokens=0):
    return CompletionDelta(request_id="r", index=0, text=text, token_ids=ids,
                           finish_reason=finish, num_prompt_tokens=prompt_tokens)


def _events(sse: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in sse.split(b"\n\n") if line.startswith(b"data: {")]


def test_chat_echo_shows_the_last_message_of_the_answers_role():
    body = {"messages": [*USER, {"role": "assistant", "content": "Sure:"}], "echo": True}
    req = decode_chat_request(json.dumps(body).encode())
    acc = ResponseAccumulator(req, "m")
    acc.add(_delta(" yes", [5], 0, 3))
    assert json.loads(acc.body())["choices"][0]["message"]["content"] == "Sure: yes"
    enc = StreamEncoder(decode_chat_request(json.dumps({**body, "stream": True}).encode()), "m")
    deltas = [c["delta"] for e in _events(enc.chunk(_delta(" yes", [5], 0, 3)))
              for c in e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure: yes"
    # the last message is the user's, and the answer the assistant's: nothing echoed
    user_last = decode_chat_request(json.dumps({"messages": USER, "echo": True}).encode())
    assert user_last.echoed() == ""


def test_continuous_usage_stats_puts_usage_in_every_chunk():
    body = {"prompt": "hi", "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    enc = StreamEncoder(decode_completion_request(json.dumps(body).encode()), "m")
    first = _events(enc.chunk(_delta("a", [7], None, 3)))
    second = _events(enc.chunk(_delta("b", [8], 0)))
    assert [e["usage"]["completion_tokens"] for e in first + second] == [1, 2]
    assert second[0]["usage"]["prompt_tokens"] == 3
    plain = StreamEncoder(decode_completion_request(json.dumps(
        {**body, "stream_options": {"include_usage": True}}).encode()), "m")
    assert "usage" not in _events(plain.chunk(_delta("a", [7], None, 3)))[0]
    answer = {"object": "text_completion", "id": "x", "choices": [
        {"index": 0, "text": "a", "finish_reason": "stop"}], "usage": {"total_tokens": 4}}
    assert all("usage" in e for e in _events(relay.as_stream(answer, True, True)))


def test_the_orchestrator_answers_a_refusal_itself():
    """No worker behind it (127.0.0.1:9): the 400 is the orchestrator's own."""
    async def answer(body: dict) -> tuple[int, dict]:
        nowhere = PoolConfig(("http://127.0.0.1:9",))
        orch = Orchestrator(ClusterConfig(nowhere, nowhere, port=0, internal_secret="s"))
        await orch.start()
        try:
            data = json.dumps(body).encode()
            reader, writer = await asyncio.open_connection("127.0.0.1", orch.http.port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(data), data))
            raw = await reader.read()
            writer.close()
            head, _, payload = raw.partition(b"\r\n\r\n")
            return int(head.split()[1]), json.loads(payload)
        finally:
            await orch.stop()
    status, body = asyncio.run(answer({"messages": USER, "response_format": {"type": "bogus"}}))
    assert status == 400 and body["error"]["param"] == "response_format"
    status, body = asyncio.run(answer({"messages": USER, "stream_options": {}}))
    assert status == 400 and body["error"]["param"] == "stream_options"


def test_a_request_template_needs_the_servers_trust():
    body = {"messages": USER, "chat_template": "{{ messages[0].content }}"}
    with pytest.raises(InvalidRequestError) as err:
        relay.check_fields(body, True, UnknownFields("orch"))
    assert err.value.param == "chat_template"
    relay.check_fields(body, True, UnknownFields("orch"), trust_templates=True)
    req = decode_chat_request(json.dumps(body).encode())
    assert chat_prompt(_tok(), req, 4096)[0] == "hi"


def test_template_flags_reach_the_configs(tmp_path):
    from splitserve.cli import build_parser, server_config
    from splitserve.orchestrator.up import cluster_config, worker_command
    from splitserve.server.config import ServerConfig
    template = tmp_path / "t.jinja"
    template.write_text("T:{{ messages[-1].content }}")
    args = build_parser().parse_args(["serve", "--chat-template", str(template),
                                      "--trust-request-chat-template"])
    config = server_config(args)
    assert config.chat_template == str(template) and config.trust_request_chat_template
    assert not server_config(build_parser().parse_args(["serve"])).trust_request_chat_template
    with pytest.raises(ValueError, match="chat template file"):
        ServerConfig(chat_template=str(tmp_path / "missing"))
    up = build_parser().parse_args(["up", "--chat-template", str(template),
                                    "--trust-request-chat-template"])
    cluster = cluster_config(up, {"SPLITSERVE_INTERNAL_SECRET": "s"})
    assert cluster.chat_template == str(template) and cluster.trust_request_chat_template
    from splitserve.placement import WorkerPlan
    cmd = worker_command(up, "ctx", 8001, WorkerPlan((0,), 1, (0,)))
    assert cmd[cmd.index("--chat-template") + 1] == str(template)
    assert "--trust-request-chat-template" in cmd


def test_nested_fields_are_implemented_or_refused():
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    tool_history = [*USER, {"role": "assistant", "content": None, "tool_calls": calls}]
    req = decode_chat_request(json.dumps({"messages": tool_history}).encode())
    assert req.conversation()[1]["tool_calls"] == [      # arguments decoded, as templates read
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]
    with pytest.raises(InvalidRequestError) as err:
        decode_chat_request(json.dumps({"messages": [{**USER[0], "tool_calls": calls}]}).encode())
    assert err.value.param == "messages[0].tool_calls"
    answer = [*USER, {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    req = decode_chat_request(json.dumps({"messages": answer}).encode())
    assert req.conversation()[1]["tool_call_id"] == "c1"     # the template may read it
    body = {"prompt": "hi", "stream": True, "stream_options": {"include_obfuscation": True}}
    with pytest.raises(InvalidRequestError) as worker:
        decode_completion_request(json.dumps(body).encode())
    with pytest.raises(InvalidRequestError) as orch:
        relay.parse_body(json.dumps(body).encode())
    assert worker.value.param == orch.value.param == "stream_options.include_obfuscation"
    body["stream_options"] = {"include_obfuscation": False}
    decode_completion_request(json.dumps(body).encode())
    relay.parse_body(json.dumps(body).encode())


def test_the_api_page_lists_every_field_as_the_code_decides_it():
    import pathlib
    import re
    page = next(p / "docs" / "api.md" for p in pathlib.Path(__file__).resolve().parents
                if (p / "docs" / "api.md").exists()).read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| [a-z]+ \| (implemented|refused) \|", page, re.M))
    assert rows == {name: f.status for name, f in FIELDS.items()}
