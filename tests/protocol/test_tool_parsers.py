"""Tool-call parsers on texts (the model's free output is random with tiny-random, so the
formats are read here from written answers): whole answers, the same answers streamed in
every split, and each format's grammar parsed back by its own parser."""

import json
import random

import pytest

from splitserve.protocol.openai_tool_calls import ToolDeltas, tool_message
from splitserve.protocol.tool_parsers import (
    PARSERS, ToolCall, family_parser, get_parser)
from splitserve.protocol.tool_parsers.stream import ToolStream

WEATHER = ToolCall("get_weather", '{"city": "Paris", "days": 2}')
NOW = ToolCall("now", "{}")

HERMES_CASES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
     '</tool_call>', None, [WEATHER]),
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": 2}}\n</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>',
     "Let me look.\n", [WEATHER, NOW]),
    ("Paris is sunny.", "Paris is sunny.", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"ci',     # cut: content
     '<tool_call>\n{"name": "get_weather", "arguments": {"ci', []),
    ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes_whole_answers(text, content, calls):
    assert get_parser("hermes").parse(text) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', None, [WEATHER]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
     '{"name": "now", "parameters": {}}', None, [WEATHER, NOW]),
    ("It is sunny.", "It is sunny.", []),
    ('{"name": "get_weather", "parameters": {"city"', '{"name": "get_weather", '
     '"parameters": {"city"', []),
])
def test_llama3_json_whole_answers(text, content, calls):
    assert get_parser("llama3_json").parse(text) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
     '{"name": "now", "arguments": {}}]', None, [WEATHER, NOW]),
    ('Sure. [TOOL_CALLS][{"name": "now", "arguments": {}}]', "Sure. ", [NOW]),
    ("No calls.", "No calls.", []),
])
def test_mistral_whole_answers(text, content, calls):
    assert get_parser("mistral").parse(text) == (content, calls)


def _streamed(parser, text, cuts):
    stream, content, calls, at = ToolStream(parser), [], [], 0
    for cut in [*cuts, len(text)]:
        c, k = stream.feed(text[at:cut])
        content.append(c)
        calls += k
        at = cut
    c, k = stream.finish()
    return "".join(content) + c, calls + k


@pytest.mark.parametrize("name, text", [
    ("hermes", HERMES_CASES[1][0]), ("hermes", "plain <tool text and < more"),
    ("hermes", HERMES_CASES[3][0]),
    ("llama3_json", '<|python_tag|>{"name": "now", "parameters": {}}'),
    ("llama3_json", "  Just words, {not a call}."),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "now", "arguments": {}}]'),
])
def test_streamed_in_any_pieces_equals_whole(name, text):
    parser, rng = get_parser(name), random.Random(5)
    whole_content, whole_calls = parser.parse(text)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(8, len(text) - 1))))
        content, calls = _streamed(parser, text, cuts)
        assert (content, calls) == (whole_content or "", whole_calls), cuts


def test_hermes_streams_content_at_once_and_each_call_when_it_closes():
    stream = ToolStream(get_parser("hermes"))
    assert stream.feed("Looking it up <tool") == ("Looking it up ", [])   # '<tool' held
    assert stream.feed('_call>{"name": "now", "arguments": {}}') == ("", [])
    assert stream.feed("</tool_call>\n<tool_call>") == ("", [NOW])


def test_openai_shapes_whole_and_streamed():
    parser = get_parser("hermes")
    message, made = tool_message(parser, HERMES_CASES[0][0])
    assert made and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": WEATHER.arguments}
    deltas = ToolDeltas(parser)
    out = deltas.feed(HERMES_CASES[0][0]) + deltas.finish()
    head, args = out[0]["tool_calls"][0], out[1]["tool_calls"][0]
    assert head["index"] == 0 and head["function"] == {"name": "get_weather", "arguments": ""}
    assert head["id"].startswith("call_") and head["type"] == "function"
    assert args == {"index": 0, "function": {"arguments": WEATHER.arguments}}


def test_family_from_the_chat_template():
    assert family_parser("<|im_start|>{{ m }}") == "hermes"
    assert family_parser("<|start_header_id|>") == "llama3_json"
    assert family_parser("[INST] {{ m }} [/INST]") == "mistral"
    assert family_parser(None) == "hermes"
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_parser("pythonic")


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1,
                                                    "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_each_format_grammar_is_parsed_back_by_its_parser(tiny_source, name):
    """Random walks through the calls' grammar (any token it allows) parse into calls of
    the named tools whose arguments satisfy the schema."""
    import numpy as np
    from splitserve.grammar_compile import GrammarCompiler, fill_mask, mask_words
    from splitserve.protocol.grammar import LARK, GrammarSpec
    tok, parser = tiny_source.tokenizer, get_parser(name)
    schemas = [parser.call_schema("get_weather", SCHEMA),
               parser.call_schema("now", {"type": "object", "additionalProperties": False})]
    compiler = GrammarCompiler(tok.to_json(), tok.vocab_size, tok.eos_token_ids)
    template = compiler.compile(GrammarSpec(LARK, parser.grammar(schemas, True), "tools"))
    rng, mask = np.random.default_rng(1), np.zeros(mask_words(tok.vocab_size), np.int32)
    for walk in range(4):
        m, ids = template.deep_copy(), []
        while True:
            fill_mask(m, mask)
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8),
                                                   bitorder="little")[:tok.vocab_size])
            words = np.setdiff1d(allowed, tok.eos_token_ids)
            if len(words) < len(allowed) and (len(ids) > 40 or rng.random() < 0.3 or
                                              not len(words)):
                break     # the grammar may end here: end it
            t = int(rng.choice(words))
            assert m.consume_token(t), m.get_error()
            ids.append(t)
        content, calls = parser.parse(tok.decode(ids, skip_special_tokens=False))
        assert calls and content is None, (walk, tok.decode(ids))
        for call in calls:
            args = json.loads(call.arguments)
            assert call.name in ("get_weather", "now")
            if call.name == "get_weather":
                assert set(args) == {"city", "days"} and 1 <= args["days"] <= 7
