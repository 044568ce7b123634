"""An answer's tool calls as OpenAI's chat responses carry them (the worker front-end
shapes them, protocol/openai_responses.py; the orchestrator passes them through).

Whole: the message's `content` (None when only calls were written) and `tool_calls`, each
{"id": "call_...", "type": "function", "function": {"name", "arguments"}}, arguments a
JSON object's text. Streamed: content deltas as the text outside calls arrives; per call
a delta with its index, id, type, name and arguments "", then one with its arguments.
`finish_reason` is "tool_calls" when the answer made calls and stopped by itself."""

from __future__ import annotations

import secrets

from splitserve.protocol.tool_parsers import ToolCall, ToolParser
from splitserve.protocol.tool_parsers.stream import ToolStream

TOOL_CALLS = "tool_calls"


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_message(parser: ToolParser, text: str) -> tuple[dict, bool]:
    """(a whole answer's message, whether it made calls)."""
    content, calls = parser.parse(text)
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
    return message, bool(calls)


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    return TOOL_CALLS if made_calls and reason == "stop" else reason


class ToolDeltas:
    """One streamed choice's deltas: `feed` each text as it arrives, `finish` at its end."""

    def __init__(self, parser: ToolParser):
        self.stream = ToolStream(parser)
        self.made = 0

    def feed(self, text: str) -> list[dict]:
        return self._deltas(*self.stream.feed(text)) if text else []

    def finish(self) -> list[dict]:
        return self._deltas(*self.stream.finish())

    def _deltas(self, content: str, calls: list[ToolCall]) -> list[dict]:
        out = [{"content": content}] if content else []
        for call in calls:
            head = {"index": self.made, "id": call_id(), "type": "function",
                    "function": {"name": call.name, "arguments": ""}}
            out.append({"tool_calls": [head]})
            out.append({"tool_calls": [{"index": self.made,
                                        "function": {"arguments": call.arguments}}]})
            self.made += 1
        return out
