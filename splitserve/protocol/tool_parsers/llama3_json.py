"""Llama 3.1+ JSON calls: the answer is the calls and nothing else,
`{"name": ..., "parameters": {...}}`, several `; ` apart, optionally after
`<|python_tag|>`. An answer that does not start with one is content."""

from __future__ import annotations

import json

from splitserve.protocol.tool_parsers.base import ToolCall, ToolParser, calls_rule, json_call

PYTHON_TAG = "<|python_tag|>"
_decoder = json.JSONDecoder()


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    arguments_key = "parameters"
    keeps_special_tokens = True

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        calls, at = [], 0
        while at < len(body) and body.startswith("{", at):
            try:
                value, at = _decoder.raw_decode(body, at)
            except ValueError:
                break
            call = json_call(value, self.arguments_key)
            if call is None:
                break
            calls.append(call)
            at = _skip_separator(body, at)
        if not calls or at < len(body):
            return (text if text.strip() else None), []
        return None, calls

    def start(self, text: str, at_beginning: bool) -> tuple[int, int]:
        if not at_beginning:
            return -1, 0
        lead = text.lstrip()
        if not lead:
            return -1, len(text)
        if lead.startswith("{") or lead.startswith(PYTHON_TAG):
            return len(text) - len(lead), 0
        if PYTHON_TAG.startswith(lead):
            return -1, len(text)
        return -1, 0

    def grammar(self, call_schemas: list[dict], parallel: bool) -> str:
        return "\n".join(calls_rule(call_schemas, parallel, "", "", '"; "')) + "\n"


def _skip_separator(body: str, at: int) -> int:
    rest = body[at:].lstrip()
    if rest.startswith(";"):
        rest = rest[1:].lstrip()
    return len(body) - len(rest)
