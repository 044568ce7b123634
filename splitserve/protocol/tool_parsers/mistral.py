"""Mistral calls: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`;
text before the marker is content. The marker is a special token in Mistral's
vocabularies, so these answers are detokenized with special tokens kept."""

from __future__ import annotations

import json

from splitserve.protocol.tool_parsers.base import (
    ToolCall, ToolParser, calls_rule, held_prefix, json_call)

MARKER = "[TOOL_CALLS]"
_decoder = json.JSONDecoder()


class MistralParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(MARKER)
        if at < 0:
            return (text if text.strip() else None), []
        body = text[at + len(MARKER):].lstrip()
        try:
            value, end = _decoder.raw_decode(body)
        except ValueError:
            return text, []
        items = value if isinstance(value, list) else [value]
        calls = [json_call(v, self.arguments_key) for v in items]
        if not calls or None in calls:
            return text, []
        content = text[:at] + body[end:]
        return (content if content.strip() else None), calls

    def start(self, text: str, at_beginning: bool) -> tuple[int, int]:
        at = text.find(MARKER)
        return (at, 0) if at >= 0 else (-1, held_prefix(text, MARKER))

    def grammar(self, call_schemas: list[dict], parallel: bool) -> str:
        rules = calls_rule(call_schemas, parallel, "", "", '", "')
        rules[0] = rules[0].replace("start:", "calls:", 1)
        return "\n".join([f"start: {json.dumps(MARKER + '[')} calls \"]\"", *rules]) + "\n"
