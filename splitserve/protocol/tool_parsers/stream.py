"""A streamed answer's tool calls, found as its text arrives (one ToolStream per choice).

Text before the calls is content, sent as it comes, less a tail that may begin a call's
marker (held until the next text says). From the calls' start on, text is held: each call
goes out whole once complete (formats that can tell: hermes), the rest when the answer
ends, parsed as a whole answer's would be; text after the calls is content then."""

from __future__ import annotations

from splitserve.protocol.tool_parsers.base import ToolCall, ToolParser


class ToolStream:
    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.held = ""
        self.in_calls = False
        self.seen = False           # any text before the held one
        self.calls = 0              # calls handed out so far

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls complete now) after `text` arrived."""
        self.held += text
        if not self.in_calls:
            at, keep = self.parser.start(self.held, not self.seen)
            if at < 0:
                cut = len(self.held) - keep
                out, self.held = self.held[:cut], self.held[cut:]
                self.seen = self.seen or bool(out)
                return out, []
            out, self.held, self.in_calls = self.held[:at], self.held[at:], True
            self.seen = True
            return out, self._take()
        return "", self._take()

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content, calls) of whatever is held when the answer ends."""
        held, self.held = self.held, ""
        if not self.in_calls:
            return held, []
        content, calls = self.parser.parse(held)
        self.calls += len(calls)
        return content or "", calls

    def _take(self) -> list[ToolCall]:
        calls, self.held = self.parser.take_calls(self.held)
        self.calls += len(calls)
        return calls
