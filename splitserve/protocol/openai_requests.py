"""OpenAI request bodies (/v1/completions, /v1/chat/completions, and vLLM's /tokenize) as
msgspec Structs.

Decoding checks types and shapes (`decode_*`); `.sampling_params()` maps the request onto
SamplingParams, which checks value ranges. Both raise InvalidRequestError naming the
offending parameter, so the HTTP layer answers 400 without guessing. Which fields exist
and which are refused is protocol/openai_fields.py's list. A refused field is no field of
these Structs: `decode_*` first decodes a body with a decoder that refuses every
field the Struct lacks, so a body with none of them (nearly all) costs nothing more; a body
with some is decoded again, its keys listed, each refused field's value checked
(`refuse_unsupported`) and each unknown one told to `unknown` (one warning per name)."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import msgspec

from splitserve.errors import InvalidRequestError
from splitserve.protocol.cache_salt import check_cache_salt
from splitserve.protocol.disagg import DisaggregatedParams
from splitserve.protocol.grammar import ResponseFormat, grammar_spec
from splitserve.protocol.tools import check_tools
from splitserve.protocol.tools import mode as tool_mode
from splitserve.protocol.openai_fields import (
    CHAT, COMPLETIONS, UnknownFields, refuse_obfuscation, refuse_unsupported)
from splitserve.sampling_params import INT32_MAX, MAX_N, MAX_STOP, SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_PROMPTS = 128          # prompts in one completions batch (each runs n sequences)


class StreamOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None    # vLLM: usage in every chunk too
    include_obfuscation: bool | None = None       # OpenAI's padding: never sent here

    def __post_init__(self):
        refuse_obfuscation(self.include_obfuscation)


STREAM_OPTIONS_NEED_STREAM = "stream_options is only allowed when stream is true"

class _BaseRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Fields both endpoints share. Optional fields accept an explicit null (clients send
    them) and mean the default."""
    model: str | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None    # token id (as JSON key) -> bias
    seed: int | None = None
    user: str | None = None
    # vLLM-style extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    spaces_between_special_tokens: bool | None = None
    best_of: int | None = None
    echo: bool | None = None
    # Requests share prefix-cache blocks only if they share it (protocol/cache_salt.py)
    cache_salt: str | None = None
    disaggregated_params: DisaggregatedParams | None = None
    # Structured output (protocol/grammar.py): at most one of these
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json_object: bool | None = None

    @property
    def _generation_only(self) -> bool:
        dp = self.disaggregated_params
        return dp is not None and dp.request_type == "generation_only"

    def __post_init__(self):
        _check(self.n is None or self.n <= MAX_N, f"n must be at most {MAX_N}", "n")
        _check(not isinstance(self.stop, list) or len(self.stop) <= MAX_STOP,
               f"at most {MAX_STOP} stop strings are supported", "stop")
        _check(self.prompt_logprobs is None or not self.stream,
               "prompt_logprobs is not supported with stream", "prompt_logprobs")
        _check(self.stream_options is None or bool(self.stream), STREAM_OPTIONS_NEED_STREAM,
               "stream_options")
        _check(self.best_of is None or self.best_of == (self.n or 1),
               "best_of is not supported (it must equal n)", "best_of")
        check_cache_salt(self.cache_salt)
        self.grammar()   # a bad response_format or guided_* field is a 400 at decoding

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM: every chunk carries the usage so far (with include_usage only)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None) -> SamplingParams:
        def pick(value, default):
            return default if value is None else value
        return SamplingParams(
            n=pick(self.n, 1), max_tokens=max_tokens, min_tokens=pick(self.min_tokens, 0),
            temperature=pick(self.temperature, 1.0), top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, 0), min_p=pick(self.min_p, 0.0), seed=self.seed,
            repetition_penalty=pick(self.repetition_penalty, 1.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            presence_penalty=pick(self.presence_penalty, 0.0),
            logit_bias=_logit_bias(self.logit_bias),
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            ignore_eos=bool(self.ignore_eos), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=pick(self.skip_special_tokens, True),
            grammar=self.grammar())

    def grammar(self):
        """Structured output's GrammarSpec, or None (protocol/grammar.py)."""
        return grammar_spec(lambda name: getattr(self, name))


class CompletionRequest(_BaseRequest, kw_only=True, omit_defaults=True):
    _endpoint = COMPLETIONS
    # msgspec allows one array-like type per union: homogeneity is checked in __post_init__.
    # None only for generation_only: the prompt then arrives in disaggregated_params.
    prompt: str | list[str | int | list[int]] | None = None
    max_tokens: int | None = 16               # null: up to the model's context
    logprobs: int | None = None               # alternatives per token, 0..20
    add_special_tokens: bool = True           # the tokenizer's (a BOS)

    def __post_init__(self):
        super().__post_init__()
        if self.prompt is not None or not self._generation_only:
            _check(self.prompt is not None, "prompt is required", "prompt")
            _check_prompt(self.prompt)

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list of strings or a list of token-id lists."""
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else p

    def sampling_params(self) -> SamplingParams:
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:   # echo shows the prompt tokens' logprobs
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        return self._sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class CalledFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str        # a JSON object's text, as OpenAI sends it


class HistoryCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An assistant's earlier tool call, as a client sends it back in the history."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction

    def to_dict(self) -> dict:
        """What chat templates read: Llama 3's, Qwen2's and ours write `arguments` with
        tojson, so it is the decoded object where the text is one (as vLLM passes it)."""
        try:
            args = json.loads(self.function.arguments)
        except ValueError:
            args = self.function.arguments
        call = {"type": "function", "function": {"name": self.function.name,
                                                 "arguments": args}}
        if self.id is not None:
            call["id"] = self.id
        return call


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None   # a list of parts is flattened to a str
    name: str | None = None
    tool_call_id: str | None = None      # a tool message's: which call it answers
    tool_calls: list[HistoryCall] | None = None   # an assistant's earlier calls

    def __post_init__(self):
        _check(not self.tool_calls or self.role == "assistant",
               "only an assistant message has tool_calls", "tool_calls")
        if isinstance(self.content, list):
            for i, part in enumerate(self.content):
                _check(part.type == "text" and part.text is not None,
                       f"content part type {part.type!r} is not supported (only 'text')",
                       f"content[{i}]")
            self.content = "\n".join(part.text for part in self.content)

    def to_dict(self) -> dict:
        """What the chat template reads."""
        msg = {"role": self.role, "content": self.content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            msg["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        return msg


class Function(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A function the model may call (protocol/tools.py); the chat template reads it."""
    type: Literal["function"]
    function: Function


_tools_type = list[Tool]


class ChatCompletionRequest(_BaseRequest, kw_only=True, omit_defaults=True):
    _endpoint = CHAT
    messages: list[ChatMessage] | None = None    # None only for generation_only (see prompt)
    max_tokens: int | None = None             # deprecated by OpenAI: max_completion_tokens wins
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False      # vLLM: the last message is left open
    add_special_tokens: bool = False          # vLLM: a BOS on top of the template's
    chat_template: str | None = None          # only where the server trusts it
    chat_template_kwargs: dict | None = None
    tools: Any = None                         # JSON values, checked by protocol/tools.py
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.messages is not None or not self._generation_only:
            _check(bool(self.messages), "messages must not be empty", "messages")
        check_continuation(self)
        if self.tools is not None or self.tool_choice is not None:
            check_tools(lambda name: getattr(self, name, None))
        if self.tools:
            self.tools = _decode(lambda t: msgspec.convert(t, _tools_type), self.tools)
        _check(self.top_logprobs is None or 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
               f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")
        _check(bool(self.logprobs) or not self.top_logprobs,
               "top_logprobs requires logprobs to be true", "top_logprobs")
        check_template_kwargs(self.chat_template_kwargs)

    def conversation(self) -> list[dict]:
        return conversation(self.messages)

    @property
    def tool_mode(self) -> str:
        """none, auto, required or the named function (protocol/tools.mode)."""
        return tool_mode(self.tools, self.tool_choice)

    def echoed(self) -> str:
        """echo (vLLM): the last message's content, shown before the answer when it has the
        answer's role (the assistant's, or with add_generation_prompt false, its own)."""
        if not self.echo or not self.messages:
            return ""
        last = self.messages[-1]
        if self.add_generation_prompt and last.role != "assistant":
            return ""
        return last.content or ""

    def sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self._sampling_params(max_tokens, logprobs, self.prompt_logprobs)
        except InvalidRequestError as exc:   # name the field the client actually sent
            if exc.param == "max_tokens" and self.max_completion_tokens is not None:
                exc.param = "max_completion_tokens"
            raise


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize: a prompt's ids, or a chat request's, the ids chat completions makes
    of the same fields (protocol/prompts.chat_prompt)."""
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True           # a prompt's; a template writes a chat's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None

    def __post_init__(self):
        _check((self.prompt is None) != (self.messages is None),
               "send exactly one of prompt or messages", "prompt")
        check_template_kwargs(self.chat_template_kwargs)
        check_continuation(self)


# Names the chat template call takes itself: passed again as keywords they would collide.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "self", "source"})


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """What a chat template reads of the messages."""
    return [m.to_dict() for m in messages]


def check_continuation(chat) -> None:
    """continue_final_message leaves the last message open for the model to go on: no
    generation prompt may follow it (vLLM's rule)."""
    if not getattr(chat, "continue_final_message", False):
        return
    _check(not chat.add_generation_prompt, "continue_final_message and add_generation_prompt "
           "cannot both be true (add_generation_prompt is true unless sent false)",
           "continue_final_message")


def check_template_kwargs(kwargs: dict | None) -> None:
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs or ()))
    _check(not reserved, f"chat_template_kwargs must not set {', '.join(reserved)} (the "
           f"request's own fields set what the template reads)", "chat_template_kwargs")



_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_raw_object_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])


class _StrictCompletion(CompletionRequest, forbid_unknown_fields=True):
    pass


class _StrictChat(ChatCompletionRequest, forbid_unknown_fields=True):
    pass


_strict_decoders = {COMPLETIONS: msgspec.json.Decoder(_StrictCompletion),
                    CHAT: msgspec.json.Decoder(_StrictChat)}
_UNKNOWN_FIELD = "Invalid request body: Object contains unknown field"


def decode_completion_request(body: bytes, unknown: UnknownFields | None = None,
                              ) -> CompletionRequest:
    return _decode_noting(_completion_decoder, body, unknown, COMPLETIONS)


def decode_chat_request(body: bytes, unknown: UnknownFields | None = None,
                        ) -> ChatCompletionRequest:
    return _decode_noting(_chat_decoder, body, unknown, CHAT)


def _decode_noting(decoder, body: bytes, unknown: UnknownFields | None, endpoint: str):
    """Decoded as `decoder` decodes it, its refused fields refused (a 400 naming one) and,
    with `unknown`, the names of fields no schema knows told to it. A body with no field the
    Struct lacks (nearly every one) is decoded once, by a decoder that refuses such fields;
    only one with some is decoded again and its keys listed."""
    try:
        return _decode(_strict_decoders[endpoint].decode, body)
    except InvalidRequestError as exc:
        if exc.param is not None or not exc.message.startswith(_UNKNOWN_FIELD):
            raise
    req = _decode(decoder.decode, body)
    fields = _raw_object_decoder.decode(body)
    _decode(lambda f: refuse_unsupported(lambda name: _json_value(f.get(name)), endpoint),
            fields)   # (a value nested too deep is a 400 too)
    if unknown is not None:
        unknown.check(fields, endpoint)
    return req


def _json_value(raw: msgspec.Raw | None):
    return None if raw is None else msgspec.json.decode(raw)


def decode_tokenize_request(body: bytes) -> TokenizeRequest:
    return _decode(_tokenize_decoder.decode, body)


def convert_chat_request(fields: dict) -> ChatCompletionRequest:
    """A chat request of Python values (LLM.chat; the orchestrator's copy of a body's chat
    fields), checked as decode_chat_request checks a body."""
    return _decode(_convert_chat, fields)


def _convert_chat(fields: dict) -> ChatCompletionRequest:
    return msgspec.convert(fields, ChatCompletionRequest)


def _decode(decode, body):
    """decode(body), its errors as InvalidRequestError naming the parameter."""
    try:
        return decode(body)
    except msgspec.ValidationError as exc:
        path = _error_path(str(exc))
        cause = exc.__cause__
        if isinstance(cause, InvalidRequestError):   # raised by a __post_init__ at `path`
            raise InvalidRequestError(cause.message, _join(path, cause.param)) from None
        missing = _MISSING_FIELD.search(str(exc))
        if missing:
            path = _join(path, missing.group(1))
        elif not path and str(exc).startswith("Expected `object`"):
            raise InvalidRequestError("Request body must be a JSON object") from None
        raise InvalidRequestError(f"Invalid request body: {exc}", path or None) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"Request body is not valid JSON: {exc}") from None
    except RecursionError:    # msgspec parses nested arrays and objects recursively
        raise InvalidRequestError("Request body nests arrays or objects too deeply") from None


_ERROR_PATH = re.compile(r" - at `\$(.*)`$")
_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")


def _error_path(message: str) -> str:
    """msgspec appends "- at `$.messages[0].role`": -> "messages[0].role". Dict values show
    as `[...]`, which names no key: dropped."""
    match = _ERROR_PATH.search(message)
    if not match:
        return ""
    path = match.group(1).removeprefix(".")
    return path.removesuffix("[...]")


def _join(path: str, param: str | None) -> str | None:
    if not path or param is None:
        return param or path or None
    if param == path or param.startswith((path + ".", path + "[")):
        return param          # the error already names its full location
    return f"{path}.{param}"


def _check_prompt(prompt) -> None:
    """A string, or a list of strings, token ids or token-id lists (not a mix), none empty.
    Ids must be int32 here; whether they are in the vocabulary is the engine's check."""
    _check(len(prompt) > 0, "prompt must not be empty", "prompt")
    if isinstance(prompt, str):
        return
    try:   # a C-level pass: a token-id prompt can be 100k items long
        msgspec.convert(prompt, _PROMPT_LIST_TYPES[type(prompt[0])])
    except msgspec.ValidationError:
        raise InvalidRequestError("prompt must be a string, a list of strings, a list of token "
                                  "ids or a list of token-id lists, not a mix", "prompt") from None
    _check(not isinstance(prompt[0], (str, list)) or all(prompt),
           "prompt must not contain an empty string or token-id list", "prompt")
    _check(not isinstance(prompt[0], (str, list)) or len(prompt) <= MAX_PROMPTS,
           f"a batch holds at most {MAX_PROMPTS} prompts", "prompt")
    for ids in [prompt] if isinstance(prompt[0], int) else prompt:
        _check(isinstance(ids, str) or (0 <= min(ids) and max(ids) <= INT32_MAX),
               f"prompt token ids must be between 0 and {INT32_MAX}", "prompt")


_PROMPT_LIST_TYPES = {str: list[str], int: list[int], list: list[list[int]]}


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        # Token ids are short decimal numbers: int() of a long digit string is quadratic.
        _check(_TOKEN_ID_KEY.fullmatch(key) is not None,
               f"logit_bias keys must be token ids, got {key[:20]!r}", "logit_bias")
        out[int(key)] = value
    return out


_TOKEN_ID_KEY = re.compile(r"\s*[+-]?\d{1,10}\s*", re.ASCII)


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param)
