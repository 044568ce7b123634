"""What every tool-call format provides (tool_parsers/__init__.py registers them)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import ClassVar, NamedTuple

# JSON in calls is written in the style structured output writes it (grammar_compile.py)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolCall(NamedTuple):
    name: str
    arguments: str      # a JSON object's text, as OpenAI sends it


class ToolParser(ABC):
    """A model family's tool-call format. Stateless: one instance serves every request.

    `parse` reads a whole answer; `start` says where calls begin in a streamed one (what
    comes before is content, sent as it arrives); `take_calls` hands out calls that are
    complete while the answer is still streaming (default: none before the end)."""
    name: ClassVar[str]
    arguments_key: ClassVar[str] = "arguments"
    # The format's markers are special tokens the detokenizer would otherwise drop
    keeps_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer: the calls it writes in this format, and the
        text outside them (None when there is none but whitespace). Text that only looks
        like a call (unclosed, not JSON) stays content."""

    @abstractmethod
    def start(self, text: str, at_beginning: bool) -> tuple[int, int]:
        """(where calls begin in text or -1, how many trailing characters to hold back
        because they may begin a call). at_beginning: text is the answer's start."""

    def take_calls(self, text: str) -> tuple[list[ToolCall], str]:
        """(calls complete at the start of text, the rest), text starting where calls do."""
        return [], text

    @abstractmethod
    def grammar(self, call_schemas: list[dict], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) of one call (parallel: one or more) in this
        format, each call's JSON matching one of call_schemas (call_schema's)."""

    def call_schema(self, name: str, parameters: dict | None) -> dict:
        """The JSON schema of one call of the named tool: {"name": name, args: parameters}.
        No parameters: no arguments (OpenAI's meaning), so "{}". The parameters' $defs move
        to the root, where their "#/$defs/..." refs point."""
        params = dict(parameters or _NO_ARGUMENTS)
        defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
        return {"type": "object", "properties": {"name": {"const": name},
                                                 self.arguments_key: params},
                "required": ["name", self.arguments_key], "additionalProperties": False,
                "x-guidance": JSON_STYLE, **defs}


def json_call(value, arguments_key: str) -> ToolCall | None:
    """A decoded {"name": ..., args: {...}} as a ToolCall; None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(value["name"], json.dumps(args, ensure_ascii=False))


def calls_rule(call_schemas: list[dict], parallel: bool, before: str, after: str,
               separator: str) -> list[str]:
    """Lark rules `start` and `call`: one call of any schema, each written between
    `before` and `after` (Lark string literals); parallel: one or more, `separator` apart."""
    alternatives = " | ".join(f"call_{i}" for i in range(len(call_schemas)))
    start = f"start: call ({separator} call)*" if parallel else "start: call"
    rules = [start, f"call: {alternatives}"]
    for i, schema in enumerate(call_schemas):
        parts = [before, "%json " + json.dumps(schema), after]
        rules.append(f"call_{i}: " + " ".join(p for p in parts if p))
    return rules


def held_prefix(text: str, marker: str) -> int:
    """The length of text's longest suffix that begins `marker` (a call may be starting)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
