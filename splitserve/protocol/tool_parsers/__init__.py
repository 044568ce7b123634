"""Tool-call formats: how a model family writes its calls, parsed back into OpenAI's
`tool_calls`, and the grammar that makes it write them (tool_choice required or named).

One module per format, one registry (`PARSERS`, by vLLM's --tool-call-parser names):
hermes (ChatML models: Qwen2, SmolLM2 with splitserve's tool template, Hermes),
llama3_json (Llama 3.1+), mistral. `family_parser` picks one from a chat template's
markers; `--tool-call-parser` overrides it. Parsers hold no state: `ToolStream`
(stream.py) keeps a streamed answer's."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.flags import flag

from splitserve.protocol.tool_parsers.base import ToolCall, ToolParser
from splitserve.protocol.tool_parsers.hermes import HermesParser
from splitserve.protocol.tool_parsers.llama3_json import Llama3JsonParser
from splitserve.protocol.tool_parsers.mistral import MistralParser

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesParser, Llama3JsonParser, MistralParser)}
DEFAULT_PARSER = HermesParser.name
# A chat template's marker -> the format its family writes calls in (first match wins)
_FAMILY_MARKERS = (("<|start_header_id|>", Llama3JsonParser.name),
                   ("[INST]", MistralParser.name),
                   ("<|im_start|>", HermesParser.name))

__all__ = ["PARSERS", "ToolCall", "ToolParser", "family_parser", "get_parser",
           "check_tool_parser", "tool_parser_field", "ToolParserFlag"]


def family_parser(chat_template: str | None) -> str:
    """The parser of the family whose markers the template writes (hermes if none does)."""
    for marker, name in _FAMILY_MARKERS:
        if chat_template and marker in chat_template:
            return name
    return DEFAULT_PARSER


def get_parser(name: str) -> ToolParser:
    """The registered parser of that name; ValueError naming the known ones otherwise."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool call parser must be one of {', '.join(PARSERS)}, "
                         f"got {name!r}") from None


def check_tool_parser(name: str | None) -> None:
    """A config's check: an unknown --tool-call-parser stops the start."""
    if name is not None:
        get_parser(name)


def tool_parser_field():
    """serve's and up's --tool-call-parser (ServerConfig, ClusterConfig)."""
    return field(default=None, metadata=flag(
        "--tool-call-parser", f"the format tool calls are parsed from and constrained to: "
                              f"{', '.join(PARSERS)} (default: the model family's)",
        choices=tuple(PARSERS)))


@dataclass(frozen=True)
class ToolParserFlag:
    """The flag alone, for a command that passes it on to its workers (up)."""
    tool_call_parser: str | None = tool_parser_field()
