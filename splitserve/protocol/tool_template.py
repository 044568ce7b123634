"""Which chat template renders a request with tools.

The model's own, where it renders `tools` (Llama 3, Qwen2, Mistral templates do). A ChatML
template that ignores them (SmolLM2's) is replaced, for requests with tools or tool turns
only, by the one this project ships (templates/tool_chatml.jinja, Hermes-style: the hermes
parser reads what it asks the model to write); every other request renders as before.
Whether a template renders tools is found once per template, by rendering a probe tool."""

from __future__ import annotations

import functools
import pathlib

from splitserve.errors import InvalidRequestError

TOOL_CHATML = "tool_chatml.jinja"
_PROBE_NAME = "splitserve_probe_function"
_PROBE = [{"type": "function", "function": {"name": _PROBE_NAME, "parameters": {}}}]
_CHATML = "<|im_start|>"


@functools.cache
def shipped_template() -> str:
    path = pathlib.Path(__file__).parent / "templates" / TOOL_CHATML
    return path.read_text(encoding="utf-8")


def wants_tool_template(chat) -> bool:
    """The request has tools, tool results or earlier calls for the template to render."""
    return bool(getattr(chat, "tools", None)) or any(
        m.role == "tool" or m.tool_calls for m in chat.messages)


@functools.lru_cache(maxsize=16)
def tool_tokenizer(tokenizer):
    """`tokenizer` with the chat template that renders tools: its own, or for a ChatML one
    that ignores them the shipped one (a copy sharing the vocabulary, made once)."""
    if renders_tools(tokenizer) or _CHATML not in (tokenizer.chat_template or ""):
        return tokenizer
    return tokenizer.replace(chat_template=shipped_template())


def renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes a tool's name into the prompt (a
    template that fails on the probe is taken to render them: it is left as it is)."""
    messages = [{"role": "user", "content": "hi"}]
    try:
        return _PROBE_NAME in tokenizer.apply_chat_template(messages, tools=_PROBE)
    except InvalidRequestError:
        return True


def describe(tokenizer) -> str:
    """What the start log says of how tools reach the model."""
    if tool_tokenizer(tokenizer) is tokenizer:
        return "the model's chat template renders tools"
    return (f"the model's chat template ignores tools: requests with tools use "
            f"splitserve's {TOOL_CHATML} (Hermes-style <tool_call>)")
