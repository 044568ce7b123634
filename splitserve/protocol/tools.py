"""A chat request's tools and tool_choice: their checks and bounds, and what they ask of
generation.

tool_choice "none": the tools are rendered into the prompt (protocol/prompts.chat_prompt),
nothing is parsed. "auto": the answer is free; the worker's tool parser turns the calls it
writes into `tool_calls`. "required" or {"type": "function", "function": {"name": ...}}:
generation is constrained by a grammar (`tool_grammar`) of one call (or, unless
parallel_tool_calls is false, several) in the parser's format, whose arguments match the
tool's parameters schema. The grammar is a Lark GrammarSpec made by the worker front-end
from the client's fields and its parser; a split request's GEN makes the same one from the
same body and resumes it over first_gen_tokens.

`check_tools` reads JSON values through get(name) (a decoded request's attributes, or the
orchestrator's parsed body), so both refuse the same input with the same 400."""

from __future__ import annotations

import json
import re

import msgspec

from splitserve.errors import InvalidRequestError
from splitserve.protocol.grammar import JSON, LARK, GrammarSpec
from splitserve.protocol.tool_parsers import ToolParser
from splitserve.sampling_params import SamplingParams

MAX_TOOLS = 128                  # OpenAI's own bound
MAX_TOOLS_BYTES = 256 * 1024     # all tools' JSON text together
MAX_SCHEMA_DEPTH = 32            # nested objects and arrays in one tool's parameters
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
NONE, AUTO, REQUIRED = "none", "auto", "required"


def check_tools(get) -> None:
    """The shape and bounds of tools, tool_choice and parallel_tool_calls; a 400 naming
    the field (`tools[3].function.name`, ...) otherwise. Nothing here compiles a schema."""
    tools = get("tools")
    if tools is not None:
        _check(isinstance(tools, list), "tools must be a list of tools", "tools")
        _check(len(tools) <= MAX_TOOLS, f"at most {MAX_TOOLS} tools are supported, got "
               f"{len(tools):,}", "tools")
        names = [_check_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
        _check(len(set(names)) == len(names), "tool names must be distinct", "tools")
        _check(len(json.dumps(tools)) <= MAX_TOOLS_BYTES,
               f"tools are too large (at most {MAX_TOOLS_BYTES:,} bytes of JSON)", "tools")
    choice = get("tool_choice")
    if choice is not None and choice not in (NONE, AUTO, REQUIRED):
        named = _named(choice)
        _check(any(_tool_name(t) == named for t in tools or ()),
               f"tool_choice names the function {named[:64]!r}, which is not in tools",
               "tool_choice.function.name")
    parallel = get("parallel_tool_calls")
    _check(parallel is None or isinstance(parallel, bool),
           "parallel_tool_calls must be a boolean", "parallel_tool_calls")


def _check_tool(tool, at: str) -> str:
    _check(isinstance(tool, dict) and tool.get("type") == "function",
           'a tool must be {"type": "function", "function": {...}}', f"{at}.type")
    fn = tool.get("function")
    _check(isinstance(fn, dict), "a tool's function must be an object", f"{at}.function")
    name = fn.get("name")
    _check(isinstance(name, str) and _NAME.fullmatch(name) is not None,
           "a function's name must be 1 to 64 letters, digits, _ . : or -",
           f"{at}.function.name")
    desc = fn.get("description")
    _check(desc is None or isinstance(desc, str), "a function's description must be a string",
           f"{at}.function.description")
    params = fn.get("parameters")
    _check(params is None or isinstance(params, dict),
           "a function's parameters must be a JSON schema object", f"{at}.function.parameters")
    _check(_depth(params) <= MAX_SCHEMA_DEPTH, f"a function's parameters may nest at most "
           f"{MAX_SCHEMA_DEPTH} levels deep", f"{at}.function.parameters")
    return name


def _depth(value) -> int:
    """How deep objects and arrays nest in value (iterative: any depth is safe to ask)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if d > MAX_SCHEMA_DEPTH:
                return d
            todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _named(choice) -> str:
    ok = (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str))
    _check(ok, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
           '"function": {"name": ...}}', "tool_choice")
    return choice["function"]["name"]


def _tool_name(tool) -> str | None:
    return tool["function"]["name"] if isinstance(tool, dict) else tool.function.name


def mode(tools, choice) -> str:
    """none, auto, required, or the named function's name. Without tools: none (vLLM's
    rule); with tools and no tool_choice: auto (OpenAI's default)."""
    if not tools or choice == NONE:
        return NONE
    if choice is None or choice in (AUTO, REQUIRED):
        return choice or AUTO
    return _named(choice)


def tool_grammar(tools: list, choice, parallel: bool | None,
                 parser: ToolParser) -> GrammarSpec | None:
    """The grammar of tool_choice required (a call to any tool) or named (to that one),
    in parser's format; None for none and auto."""
    m = mode(tools, choice)
    if m in (NONE, AUTO):
        return None
    chosen = [t.function for t in tools if m == REQUIRED or t.function.name == m]
    schemas = [parser.call_schema(f.name, f.parameters) for f in chosen]
    return GrammarSpec(LARK, parser.grammar(schemas, parallel is not False), "tools")


def parameter_specs(tools: list) -> list[GrammarSpec]:
    """Each tool's parameters as a JSON GrammarSpec naming that tool's field: compiled
    first, a schema that is not valid is a 400 naming its tool."""
    return [GrammarSpec(JSON, json.dumps(t.function.parameters),
                        f"tools[{i}].function.parameters")
            for i, t in enumerate(tools) if t.function.parameters is not None]


def with_tools(req, params: SamplingParams,
               parser: ToolParser) -> tuple[SamplingParams, list[GrammarSpec]]:
    """A chat request's SamplingParams under its tool_choice (with the calls' grammar for
    required and named), and the grammars to compile before its own: each tool's
    parameters, so a schema that does not compile is a 400 naming its tool. Unchanged
    under none."""
    if req.tool_mode == NONE:
        return params, []
    grammar = tool_grammar(req.tools, req.tool_choice, req.parallel_tool_calls, parser)
    if grammar is not None and params.grammar is not None:
        raise InvalidRequestError(f"tool_choice {req.tool_mode!r} constrains the answer to "
                                  f"tool calls: it cannot be combined with "
                                  f"{params.grammar.field}", "tool_choice")
    changes = {"grammar": grammar} if grammar is not None else {}
    if parser.keeps_special_tokens:     # the format's markers are special tokens
        changes["skip_special_tokens"] = False
    return msgspec.structs.replace(params, **changes), parameter_specs(req.tools)


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param)
