"""Hermes-style calls (Qwen2, Hermes, ChatML models with splitserve's tool template):
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one per span, anywhere in
the answer; text outside the spans is content."""

from __future__ import annotations

import json
import re

from splitserve.protocol.tool_parsers.base import (
    ToolCall, ToolParser, calls_rule, held_prefix, json_call)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_SPAN = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


class HermesParser(ToolParser):
    name = "hermes"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls, content, at = [], [], 0
        for m in _SPAN.finditer(text):
            call = _decoded(m.group(1))
            if call is not None:
                content.append(text[at:m.start()])
                calls.append(call)
                at = m.end()
        content.append(text[at:])
        # whitespace between and after calls is the format's, not content
        rest = content[0] + "".join(c for c in content[1:] if c.strip())
        return (rest if rest.strip() else None), calls

    def start(self, text: str, at_beginning: bool) -> tuple[int, int]:
        at = text.find(OPEN)
        return (at, 0) if at >= 0 else (-1, held_prefix(text, OPEN))

    def take_calls(self, text: str) -> tuple[list[ToolCall], str]:
        calls = []
        while True:
            lead = len(text) - len(text.lstrip())
            m = _SPAN.match(text, lead)
            call = _decoded(m.group(1)) if m else None
            if call is None:
                return calls, text
            calls.append(call)
            text = text[m.end():]

    def grammar(self, call_schemas: list[dict], parallel: bool) -> str:
        return "\n".join(calls_rule(call_schemas, parallel, json.dumps(OPEN + "\n"),
                                    json.dumps("\n" + CLOSE), '"\\n"')) + "\n"


def _decoded(body: str) -> ToolCall | None:
    try:
        return json_call(json.loads(body), "arguments")
    except ValueError:
        return None
