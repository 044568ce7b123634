"""Structured output's request fields: every accepted spelling becomes one GrammarSpec, and
every bad grammar is a 400 naming its field before anything reaches an engine."""

import json
import time

import pytest

from splitserve.errors import InvalidRequestError
from splitserve.grammar_compile import GrammarCompiler
from splitserve.model.loader import load_model_source
from splitserve.protocol.grammar import (ANY_JSON_OBJECT, CHOICE, JSON, LARK, MAX_CHOICES,
                                         REGEX, GrammarSpec)
from splitserve.protocol.openai_requests import decode_chat_request, decode_completion_request

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.fixture(scope="module")
def compiler():
    tok = load_model_source("tiny-random").tokenizer
    return GrammarCompiler(tok.to_json(), tok.vocab_size, tok.eos_token_ids)


def spec_of(extra, chat=True):
    if chat:
        req = decode_chat_request(json.dumps({"messages": USER, **extra}).encode())
    else:
        req = decode_completion_request(json.dumps({"prompt": "hi", **extra}).encode())
    return req.sampling_params().grammar


@pytest.mark.parametrize("extra, kind, source, field", [
    ({"response_format": {"type": "json_object"}}, JSON, ANY_JSON_OBJECT, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}}}, JSON, json.dumps(SCHEMA),
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": SCHEMA}}, JSON, json.dumps(SCHEMA), "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a+"}}, REGEX, "a+", "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, CHOICE, '["a", "b"]',
     "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, LARK, 'start: "a"',
     "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, JSON, ANY_JSON_OBJECT,
     "structured_outputs.json_object"),
    ({"guided_json": SCHEMA}, JSON, json.dumps(SCHEMA), "guided_json"),
    ({"guided_json": json.dumps(SCHEMA)}, JSON, json.dumps(SCHEMA), "guided_json"),
    ({"guided_regex": "a+"}, REGEX, "a+", "guided_regex"),
    ({"guided_choice": ["a", "b"]}, CHOICE, '["a", "b"]', "guided_choice"),
    ({"guided_grammar": 'root ::= "a"'}, LARK, 'root ::= "a"', "guided_grammar"),
    ({"guided_json_object": True, "guided_decoding_backend": "llguidance"}, JSON,
     ANY_JSON_OBJECT, "guided_json_object"),
])
@pytest.mark.parametrize("chat", [True, False])
def test_every_spelling_becomes_one_spec(extra, kind, source, field, chat):
    assert spec_of(extra, chat) == GrammarSpec(kind, source, field)


def test_text_and_nothing_mean_no_grammar():
    assert spec_of({}) is None and spec_of({"response_format": {"type": "text"}}) is None
    assert spec_of({"structured_outputs": {"regex": None}}) is None


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "bogus"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a"] * (MAX_CHOICES + 1)}, "guided_choice"),
    ({"guided_regex": "a" * 70_000}, "guided_regex"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
])
def test_bad_shapes_are_400s_naming_the_field(extra, param):
    with pytest.raises(InvalidRequestError) as err:
        spec_of(extra)
    assert err.value.param == param


def test_a_schema_nested_ten_thousand_deep_is_a_400():
    deep = "{}"
    for _ in range(10_000):
        deep = '{"type": "object", "properties": {"a": ' + deep + "}}"
    body = '{"messages": [{"role": "user", "content": "hi"}], "guided_json": ' + deep + "}"
    with pytest.raises(InvalidRequestError) as err:
        decode_chat_request(body.encode()).sampling_params()
    assert "deep" in err.value.message


@pytest.mark.parametrize("spec", [
    GrammarSpec(JSON, '{"type": "bogus"}', "guided_json"),                 # invalid schema
    GrammarSpec(JSON, "{not json", "guided_json"),
    GrammarSpec(JSON, '{"type": "string", "minLength": 5, "maxLength": 2}', "guided_json"),
    GrammarSpec(JSON, '{"allOf": [{"type": "string"}, {"type": "integer"}]}', "guided_json"),
    GrammarSpec(REGEX, "(a", "guided_regex"),
    GrammarSpec(LARK, "start: x\nx: x", "guided_grammar"),                 # matches nothing
    GrammarSpec(LARK, "start: (", "guided_grammar"),
])
def test_grammars_that_do_not_compile_are_400s_naming_the_field(compiler, spec):
    with pytest.raises(InvalidRequestError) as err:
        compiler.check(spec)
    assert err.value.param == spec.field


def test_costly_grammars_are_bounded(compiler):
    """A pathological regex and a huge alternation: a bounded time, then an answer."""
    for spec in [GrammarSpec(REGEX, "(x+x+)+y", "guided_regex"),
                 GrammarSpec(REGEX, "[a-z]{1000}{1000}", "guided_regex"),
                 GrammarSpec(CHOICE, json.dumps([f"w{i}" for i in range(MAX_CHOICES)]),
                             "guided_choice")]:
        start = time.monotonic()
        try:
            compiler.check(spec)
        except InvalidRequestError as exc:
            assert exc.param == spec.field
        assert time.monotonic() - start < 5


def test_compiled_grammars_are_cached_by_spec(compiler):
    a = compiler.compile(GrammarSpec(REGEX, "[0-9]+", "guided_regex"))
    assert compiler.compile(GrammarSpec(REGEX, "[0-9]+", "structured_outputs.regex")) is a
