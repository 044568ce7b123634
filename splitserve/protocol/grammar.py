"""Structured output: the grammar a request's answer must match, as the request spelled it.

OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs`
({json, regex, choice, grammar}) and its older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`, `guided_json_object` all become one `GrammarSpec`: a kind and its source text.
It rides in SamplingParams, so it crosses to the engine inside the EngineRequest and, as the
client's own fields, in every body the orchestrator relays. It reads no prompt token
values: a length-only (metadata) prompt takes it as any other.

Only shapes and sizes are checked here; whether the grammar compiles is
grammar_compile.py's question, asked in the front-end's tokenizer pool."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from splitserve.errors import InvalidRequestError

JSON, REGEX, CHOICE, LARK = "json", "regex", "choice", "lark"
MAX_GRAMMAR_BYTES = 64 * 1024     # a schema, regex or grammar's source text
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024
ANY_JSON_OBJECT = '{"type": "object"}'
_GUIDED = {"guided_json": JSON, "guided_regex": REGEX, "guided_choice": CHOICE,
           "guided_grammar": LARK}
_STRUCTURED = {"json": JSON, "regex": REGEX, "choice": CHOICE, "grammar": LARK}


class GrammarSpec(msgspec.Struct, frozen=True, gc=False):
    """kind: json (source: a JSON schema's text), regex, choice (source: a JSON list of
    strings) or lark (a Lark grammar, llguidance's dialect). field: the request field that
    asked for it, named by any 400 about it. Equal specs compile to the same grammar
    (its cache key is (kind, source))."""
    kind: str
    source: str
    field: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.source)


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: Any = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


def grammar_spec(get) -> GrammarSpec | None:
    """The one grammar a request asks for (None: free text); get(name) is a top-level
    field's value (None: unset): a decoded request's attribute, or a parsed body's (the
    orchestrator's check, before any worker sees it). Two ways of asking for one in one
    request is a 400 naming the second."""
    found: list[GrammarSpec] = []
    rf = get("response_format")
    if rf is not None:
        spec = _response_format(_response_format_struct(rf))
        if spec is not None:
            found.append(spec)
    so = get("structured_outputs")
    if so:
        found += _structured_outputs(so)
    for name, kind in _GUIDED.items():
        value = get(name)
        if value is not None:
            found.append(_spec(kind, value, name))
    if get("guided_json_object"):
        found.append(GrammarSpec(JSON, ANY_JSON_OBJECT, "guided_json_object"))
    if len(found) > 1:
        raise InvalidRequestError(f"{found[1].field} cannot be combined with {found[0].field}: "
                                  "a request has at most one grammar", found[1].field)
    return found[0] if found else None


def _response_format_struct(rf) -> ResponseFormat:
    if isinstance(rf, ResponseFormat):
        return rf
    try:
        return msgspec.convert(rf, ResponseFormat)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"Invalid response_format: {exc}", "response_format") from None


def _response_format(rf: ResponseFormat) -> GrammarSpec | None:
    field = "response_format"
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return GrammarSpec(JSON, ANY_JSON_OBJECT, field)
    if rf.type == "json_schema":
        js = rf.json_schema
        _check(js is not None and js.schema is not None,
               "response_format json_schema needs json_schema.schema", field + ".json_schema")
        return _spec(JSON, js.schema, field + ".json_schema.schema")
    raise InvalidRequestError(f"response_format type must be text, json_object or "
                              f"json_schema, got {rf.type[:64]!r}", "response_format")


def _structured_outputs(so: dict) -> list[GrammarSpec]:
    _check(isinstance(so, dict), "structured_outputs must be an object", "structured_outputs")
    out = []
    for key, value in so.items():
        field = f"structured_outputs.{key}"
        if key in _STRUCTURED:
            if value is not None:
                out.append(_spec(_STRUCTURED[key], value, field))
        elif key == "json_object":
            if value:
                out.append(GrammarSpec(JSON, ANY_JSON_OBJECT, field))
        elif value not in (None, False, "", [], {}):
            raise InvalidRequestError(f"{field} is not supported by this server (json, "
                                      "regex, choice, grammar and json_object are)", field)
    return out


def _spec(kind: str, value, field: str) -> GrammarSpec:
    if kind == JSON:
        _check(isinstance(value, (dict, bool, str)), "a JSON schema must be an object", field)
        source = value if isinstance(value, str) else _dumps(value, field)
    elif kind == CHOICE:
        _check(isinstance(value, list) and 0 < len(value) <= MAX_CHOICES
               and all(isinstance(c, str) and len(c) <= MAX_CHOICE_CHARS for c in value),
               f"choices must be a list of 1 to {MAX_CHOICES} strings of at most "
               f"{MAX_CHOICE_CHARS} characters", field)
        source = json.dumps(value)
    else:
        _check(isinstance(value, str) and value != "", f"{field} must be a non-empty string",
               field)
        source = value
    _check(len(source.encode()) <= MAX_GRAMMAR_BYTES,
           f"{field} is too large (at most {MAX_GRAMMAR_BYTES} bytes)", field)
    return GrammarSpec(kind, source, field)


def _dumps(value, field: str) -> str:
    try:
        return json.dumps(value)
    except RecursionError:
        raise InvalidRequestError("the JSON schema nests too deeply", field) from None


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param)
