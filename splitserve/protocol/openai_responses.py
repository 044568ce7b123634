"""OpenAI response bodies and SSE chunks, built from the engine's CompletionDeltas.

`ResponseAccumulator` collects a request's deltas into one non-streaming body;
`StreamEncoder` turns each delta into SSE bytes. The streaming path runs per token on the
event loop: the constant head of every chunk (id, object, created, model) is encoded once.
Token strings (logprobs, openai_logprobs.py) come from a `token_text(id) -> str` callable
the caller passes, so this module never touches a tokenizer."""

from __future__ import annotations

import os
import time
from typing import NamedTuple, Sequence

import msgspec

from splitserve.protocol.engine import CompletionDelta, Logprob
from splitserve.protocol.openai_logprobs import (
    TokenText, chat_logprobs, chat_logprobs_json, completion_logprobs, completion_logprobs_json,
    vllm_prompt_logprobs_json)
from splitserve.protocol.openai_requests import ChatCompletionRequest, CompletionRequest
from splitserve.protocol.openai_tool_calls import ToolDeltas, finish_reason, tool_message
from splitserve.protocol.tool_parsers import ToolParser

# Indexed by FinishReason; HANDOFF (a context_only request continuing on a generation
# worker) is not finished from the client's point of view.
FINISH_REASONS = ("stop", "length", "abort", "error", None)
DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


class EchoPrompt(NamedTuple):
    """A completions prompt shown back with echo=true. The first prompt token has no
    logprob entry, so its id is passed here for the `tokens` list."""
    text: str
    first_token_id: int | None = None


class _RandomHex:
    """128-bit random hex ids from os.urandom, read 256 at a time: one system call per 256
    requests instead of one each (it showed as ~5% of a front-end's time per request).
    Random, not a counter: a context worker leases KV under this id, which must not be
    guessable by another client. Single-threaded use (the event loop)."""

    def __init__(self, per_read: int = 256):
        self._pool, self._at, self._per_read = "", 0, per_read

    def __call__(self) -> str:
        if self._at == len(self._pool):
            self._pool, self._at = os.urandom(16 * self._per_read).hex(), 0
        self._at += 32
        return self._pool[self._at - 32:self._at]


_random_hex = _RandomHex()


def response_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + _random_hex()


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> bytes:
    return _encode({"error": {"message": message, "type": type, "param": param, "code": code}})


def status_error_body(message: str, status: int) -> bytes:
    """The body of an error a server answers by itself, by its HTTP status (what vLLM's
    types are: 404 NotFoundError, a 5xx server_error, anything else invalid_request_error)."""
    type = "NotFoundError" if status == 404 else \
        "server_error" if status >= 500 else "invalid_request_error"
    return error_body(message, type)


def sse_error(message: str, type: str = "server_error", param: str | None = None,
              code: str | int | None = None) -> bytes:
    return b"data: " + error_body(message, type, param, code) + b"\n\n"


def engine_error(delta: CompletionDelta) -> tuple[int, str, str | None]:
    """(HTTP status, error type, param) for a delta carrying an engine error. The engine sets
    error_param (possibly "") when it rejected the input: a 400; anything else is a 500."""
    if delta.error_param is not None:
        return 400, "invalid_request_error", delta.error_param or None
    return 500, "server_error", None


def _echo_items(echo: EchoPrompt, prompt_logprobs: Sequence[Logprob | None]) -> list:
    return [(echo.first_token_id, None)] + [(e.token_id, e) for e in prompt_logprobs[1:]]


# -- shared per-request state ---------------------------------------------------------------
class _Usage:
    def __init__(self):
        self.prompt: dict[int, int] = {}   # per prompt index (n siblings share a prompt)
        self.cached: dict[int, int] = {}
        self.completion = 0

    def add(self, delta: CompletionDelta, prompt_index: int) -> None:
        self.completion += len(delta.token_ids)
        if delta.num_prompt_tokens:        # set in each sequence's first delta
            self.prompt[prompt_index] = delta.num_prompt_tokens
            self.cached[prompt_index] = max(self.cached.get(prompt_index, 0),
                                            delta.num_cached_tokens)

    def to_dict(self) -> dict:
        prompt = sum(self.prompt.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion,
                "total_tokens": prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}}


class _Response:
    def __init__(self, request: CompletionRequest | ChatCompletionRequest, model: str, *,
                 token_text: TokenText | None = None, echo: Sequence[EchoPrompt] = (),
                 request_id: str | None = None, created: int | None = None,
                 tool_parser: ToolParser | None = None, tool_prefix: str = ""):
        self.chat = isinstance(request, ChatCompletionRequest)
        self.tool_parser = tool_parser if self.chat else None   # tool calls are parsed
        # A continued stream's: the text the client was sent before (a call may be open)
        self.tool_prefix = tool_prefix
        self.id = request_id or response_id(self.chat)
        self.created = int(time.time()) if created is None else created
        self.model = model
        self.n = request.n or 1
        self.token_text = token_text
        self.echo = list(echo) if not self.chat and request.echo else []
        self.chat_echo = request.echoed() if self.chat else ""   # vLLM's chat echo
        self.continuous_usage = request.continuous_usage
        self.k = (request.top_logprobs if self.chat else request.logprobs) or 0
        self.want_prompt_logprobs = request.prompt_logprobs is not None
        self.usage = _Usage()

    def _logprobs(self, entries: Sequence[Logprob], echo_items: list, offset: int):
        assert self.token_text is not None, "logprobs need a token_text callable"
        if self.chat:
            return {"content": chat_logprobs(entries, self.token_text, self.k)}, offset
        items = echo_items + [(e.token_id, e) for e in entries]
        return completion_logprobs(items, self.token_text, self.k, offset)


# -- non-streaming --------------------------------------------------------------------------
class _Choice:
    __slots__ = ("texts", "logprobs", "prompt_logprobs", "finish_reason", "stop_reason")

    def __init__(self):
        self.texts: list[str] = []
        self.logprobs: list[Logprob] | None = None
        self.prompt_logprobs: list[Logprob | None] | None = None
        self.finish_reason: int | None = None
        self.stop_reason: int | str | None = None


class ResponseAccumulator(_Response):
    """Collects the deltas of one request (n outputs for each of `num_prompts` prompts;
    choice index = prompt_index * n + delta.index) and builds the response body."""

    def __init__(self, request, model: str, *, num_prompts: int = 1, **kwargs):
        super().__init__(request, model, **kwargs)
        self.choices = [_Choice() for _ in range(self.n * num_prompts)]
        self.failure: CompletionDelta | None = None   # the first delta carrying an error

    def add(self, delta: CompletionDelta, prompt_index: int = 0) -> None:
        self.usage.add(delta, prompt_index)
        if delta.error is not None and self.failure is None:
            self.failure = delta
        if delta.index < 0:   # about the whole request (the engine died), no sequence
            return
        c = self.choices[prompt_index * self.n + delta.index]
        c.texts.append(delta.text)
        if delta.logprobs is not None:
            if c.logprobs is None:
                c.logprobs = []
            c.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            c.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason

    def error_response(self) -> tuple[int, bytes] | None:
        """(status, error body) if the engine rejected or failed the request: answer that
        instead of `body()`. None when every sequence ended normally."""
        if self.failure is None:
            return None
        status, type, param = engine_error(self.failure)
        return status, error_body(self.failure.error, type, param)

    def body(self, extra: dict | None = None) -> bytes:
        """extra: top-level fields to add (disaggregated_params of a context_only answer)."""
        choices = [self._choice(i, c) for i, c in enumerate(self.choices)]
        out = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices,
               "usage": self.usage.to_dict()}
        if self.chat and self.want_prompt_logprobs and self.choices[0].prompt_logprobs:
            out["prompt_logprobs"] = vllm_prompt_logprobs_json(self.choices[0].prompt_logprobs,
                                                               self.token_text)
        if extra:
            out.update(extra)
        return _encode(out)

    def _choice(self, index: int, c: _Choice) -> dict:
        text = "".join(c.texts)
        echo = self.echo[index // self.n] if self.echo else None
        echo_items = []
        if echo is not None:
            text = echo.text + text
            if c.prompt_logprobs is not None and c.logprobs is not None:
                echo_items = _echo_items(echo, c.prompt_logprobs)
        logprobs = None
        if c.logprobs is not None:
            logprobs = self._logprobs_json(c.logprobs, echo_items)
        reason = None if c.finish_reason is None else FINISH_REASONS[c.finish_reason]
        if self.tool_parser is not None:
            message, made = tool_message(self.tool_parser, self.chat_echo + text)
            out, reason = {"index": index, "message": message}, finish_reason(reason, made)
        elif self.chat:
            out = {"index": index, "message": {"role": "assistant",
                                               "content": self.chat_echo + text}}
        else:
            out = {"index": index, "text": text}
        out.update(logprobs=logprobs, finish_reason=reason, stop_reason=c.stop_reason)
        if not self.chat and self.want_prompt_logprobs and c.prompt_logprobs is not None:
            out["prompt_logprobs"] = vllm_prompt_logprobs_json(c.prompt_logprobs, self.token_text)
        return out

    def _logprobs_json(self, entries: Sequence[Logprob], echo_items: list) -> msgspec.Raw:
        """A whole choice's logprobs, encoded piece by piece (openai_logprobs.PIECE)."""
        assert self.token_text is not None, "logprobs need a token_text callable"
        if self.chat:
            return chat_logprobs_json(entries, self.token_text, self.k)
        items = echo_items + [(e.token_id, e) for e in entries]
        return completion_logprobs_json(items, self.token_text, self.k)


# -- streaming ------------------------------------------------------------------------------
class StreamEncoder(_Response):
    """SSE bytes for one streaming request. `chunk()` per delta (b"" when a delta carries
    nothing to show), then `usage_chunk()` if `request.include_usage`, then DONE. With
    continuous_usage_stats every chunk carries the usage so far too (vLLM)."""

    def __init__(self, request, model: str, **kwargs):
        super().__init__(request, model, **kwargs)
        obj = b"chat.completion.chunk" if self.chat else b"text_completion"
        self._head = (b'data: {"id":' + _encode(self.id) + b',"object":"' + obj
                      + b'","created":' + str(self.created).encode() + b',"model":'
                      + _encode(self.model) + b',"choices":[')
        self._started: set[int] = set()
        self._tools: dict[int, ToolDeltas] = {}   # per choice, when tool calls are parsed
        self._offsets: dict[int, int] = {}   # completions: text_offset of the next token

    def chunk(self, delta: CompletionDelta, prompt_index: int = 0) -> bytes:
        self.usage.add(delta, prompt_index)
        if delta.error is not None:   # rejected or failed: an error event, no finish chunk
            _, type, param = engine_error(delta)
            return sse_error(delta.error, type, param)
        index = prompt_index * self.n + delta.index
        out = b""
        echo_items, text = [], delta.text
        if index not in self._started:
            self._started.add(index)
            if self.chat:
                out = self._event({"index": index, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None})
                if self.chat_echo and self.tool_parser is not None:
                    text = self.chat_echo + text     # calls in it are parsed too
                elif self.chat_echo:
                    out += self._event({"index": index, "delta": {"content": self.chat_echo},
                                        "logprobs": None, "finish_reason": None})
            elif self.echo:
                echo = self.echo[prompt_index]
                text = echo.text + text
                if delta.prompt_logprobs is not None and delta.logprobs is not None:
                    echo_items = _echo_items(echo, delta.prompt_logprobs)
        if self.tool_parser is not None:
            return out + self._tool_events(index, delta, text)
        if text or delta.logprobs is not None or delta.finish_reason is not None:
            out += self._event(self._choice(index, delta, text, echo_items))
        return out

    def _tool_events(self, index: int, delta: CompletionDelta, text: str) -> bytes:
        """The text's content and tool-call deltas (openai_tool_calls.py); at the end an
        event of its own with the finish reason."""
        tools = self._tools.get(index)
        if tools is None:
            tools = self._tools[index] = ToolDeltas(self.tool_parser)
            tools.feed(self.tool_prefix)   # parsed as before, its deltas already sent
        done = delta.finish_reason is not None
        deltas = tools.feed(text) + (tools.finish() if done else [])
        logprobs = None
        if delta.logprobs is not None:
            logprobs, _ = self._logprobs(delta.logprobs, [], 0)
            deltas = deltas or [{"content": ""}]
        out = b"".join(self._event({"index": index, "delta": d, "logprobs": logprobs if k == 0
                                    else None, "finish_reason": None})
                       for k, d in enumerate(deltas))
        if done:
            reason = finish_reason(FINISH_REASONS[delta.finish_reason], tools.made > 0)
            out += self._event({"index": index, "delta": {}, "logprobs": None,
                                "finish_reason": reason, "stop_reason": delta.stop_reason})
        return out

    def usage_chunk(self) -> bytes:
        return self._head + b'],"usage":' + _encode(self.usage.to_dict()) + b"}\n\n"

    def _choice(self, index: int, delta: CompletionDelta, text: str, echo_items: list) -> dict:
        logprobs = None
        if delta.logprobs is not None:
            offset = self._offsets.get(index, 0)
            logprobs, self._offsets[index] = self._logprobs(delta.logprobs, echo_items, offset)
        if self.chat:
            out = {"index": index, "delta": {"content": text}}
        else:
            out = {"index": index, "text": text}
        out["logprobs"] = logprobs
        if delta.finish_reason is None:
            out["finish_reason"] = None
        else:
            out["finish_reason"] = FINISH_REASONS[delta.finish_reason]
            out["stop_reason"] = delta.stop_reason
        return out

    def _event(self, choice: dict) -> bytes:
        if self.continuous_usage:
            return (self._head + _encode(choice) + b'],"usage":' + _encode(self.usage.to_dict())
                    + b"}\n\n")
        return self._head + _encode(choice) + b"]}\n\n"
