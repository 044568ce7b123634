"""A prompt as every room must see it: a text's token ids, a chat request's prompt, and what
a prompt must satisfy before the engine takes it.

chat_prompt is the one place messages become a prompt. Chat completions
(server/generate.py), POST /tokenize (server/app.py), LLM.chat (llm.py) and the
orchestrator's counting (orchestrator/prompt_tokens.py) all call it, so they make the same
ids of the same request: the orchestrator's kv_aware routing and local-prefill decision hash
those ids, which name a worker's cached blocks only if they are the worker's own.

`tokenizer` is a model/tokenizer.Tokenizer (encode, apply_chat_template, surely_too_long,
max_token_chars). Encoding blocks: callers on an event loop run it in a thread."""

from __future__ import annotations

import os
from dataclasses import field

import msgspec

from splitserve.errors import InvalidRequestError
from splitserve.flags import flag
from splitserve.protocol.tool_template import tool_tokenizer, wants_tool_template
from splitserve.protocol.openai_requests import (
    ChatCompletionRequest, check_continuation, check_template_kwargs, conversation)
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens


def chat_prompt(tokenizer, chat, max_model_len: int) -> tuple[str, PromptTokens]:
    """(text, ids) of a chat request: its messages rendered by the model's chat template
    with add_generation_prompt, chat_template_kwargs and its tools (a chat request's) by
    its own chat_template if it has one (a server that allows it:
    protocol/openai_fields.refuse_request_template), else the tokenizer's (for a request
    with tools, the one that renders them: protocol/tool_template.py), cut after the last message's content under
    continue_final_message, then encoded with no special tokens added (the template wrote
    them) unless a ChatCompletionRequest asks for them with add_special_tokens. chat: a
    ChatCompletionRequest or a TokenizeRequest; its messages are ChatMessages, content parts
    already flattened. InvalidRequestError (a 400) when it cannot fit max_model_len or does
    not render."""
    check_message_count(len(chat.messages), max_model_len)
    kwargs = chat.chat_template_kwargs or {}
    check_template_kwargs(kwargs)
    check_continuation(chat)
    if getattr(chat, "tools", None):
        kwargs = {**kwargs, "tools": msgspec.to_builtins(chat.tools)}
    if getattr(chat, "chat_template", None):   # allowed by the server (openai_fields.py)
        tokenizer = tokenizer.replace(chat_template=chat.chat_template)
    elif wants_tool_template(chat):
        tokenizer = tool_tokenizer(tokenizer)
    text = tokenizer.apply_chat_template(conversation(chat.messages),
                                         add_generation_prompt=chat.add_generation_prompt,
                                         **kwargs)
    if chat.continue_final_message:
        text = open_final_message(text, chat.messages[-1].content or "")
    special = isinstance(chat, ChatCompletionRequest) and chat.add_special_tokens
    return text, encode_prompt(tokenizer, text, max_model_len, "messages",
                               add_special_tokens=special)


def open_final_message(text: str, content: str) -> str:
    """The rendered chat cut right after the last message's content, so the model goes on
    with that message instead of after its end-of-turn markers. The template may strip
    the content's surrounding whitespace: its trailing whitespace is kept only if the
    template kept it."""
    core = content.strip()
    at = text.rfind(core)
    if at < 0:
        raise InvalidRequestError("continue_final_message: the chat template does not render "
                                  "the final message's content as it is, so it cannot be "
                                  "continued", "continue_final_message")
    kept = content.lstrip()
    return text[:at + (len(kept) if text.startswith(kept, at) else len(core))]


def with_template_file(tokenizer, path: str | None):
    """The tokenizer with the chat template read from `path` (serve and up's
    --chat-template) in place of the model's; as it is without one."""
    if not path:
        return tokenizer
    with open(path, encoding="utf-8") as f:
        return tokenizer.replace(chat_template=f.read())


def template_file_field():
    """serve's and up's --chat-template (ServerConfig, ClusterConfig): a file's path."""
    return field(default=None, metadata=flag(
        "--chat-template", "a Jinja chat template file used instead of the model's",
        metavar="FILE"))


def trust_templates_field():
    """serve's and up's --trust-request-chat-template (protocol/openai_fields.py)."""
    return field(default=False, metadata=flag(
        "--trust-request-chat-template", "render a chat request's own chat_template (else a "
                                         "request carrying one gets 400)"))


def check_template_file(path: str | None) -> None:
    """A config's check: a --chat-template that names no readable file stops the start."""
    if path is not None and not os.access(path, os.R_OK):
        raise ValueError(f"chat template file {path!r} does not exist or cannot be read")


def check_message_count(count: int, max_model_len: int) -> None:
    """Every message a chat template renders adds a token at least (its role's markers):
    more messages than the context has tokens cannot fit, and are not rendered (a 64 MiB
    body of 2M messages is ~9 s of template work)."""
    if count > max_model_len:
        raise InvalidRequestError(f"{count:,} messages cannot fit in this model's maximum "
                                  f"context length of {max_model_len} tokens", "messages")


def encode_prompt(tokenizer, text: str, max_model_len: int, param: str,
                  add_special_tokens: bool = True) -> PromptTokens:
    """A text prompt's ids. A text that surely cannot fit the context is refused before it
    is encoded (a 64 MiB body encoded costs ~9 GB)."""
    if tokenizer.surely_too_long(text, max_model_len):
        raise InvalidRequestError(
            f"the prompt is {len(text):,} characters: more than this model's maximum context "
            f"length of {max_model_len} tokens can hold (at most "
            f"{max_model_len * tokenizer.max_token_chars:,} characters)", param)
    return PromptTokens(tokenizer.encode(text, add_special_tokens))


def check_prompt(prompt: PromptTokens, params: SamplingParams, vocab_size: int,
                 max_model_len: int) -> None:
    """Not empty, room for one generated token, token ids of the vocabulary (params' too).
    The engine's admission check (engine/admission.py), which the front-end runs too
    (server/admission.py): its 400 must come before a stream's head leaves."""
    n = len(prompt)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if n >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {n} tokens; this model's context is {max_model_len} tokens "
            f"including at least one generated token", "prompt")
    if not prompt.is_placeholder:
        lo, hi = int(prompt.array.min()), int(prompt.array.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary "
                                      f"[0, {vocab_size})", "prompt")
    params.check_vocab(vocab_size)
