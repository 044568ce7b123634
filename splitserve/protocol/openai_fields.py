"""Every top-level field of OpenAI's and vLLM's /v1/completions and /v1/chat/completions
request bodies, and what this server does with each: IMPLEMENTED, or REFUSED with a 400
naming it unless its value asks for nothing (null, or the value that means what this server
does anyway: `use_beam_search: false`, `response_format: {"type": "text"}`, ...).

The one list of known fields, and the one decision about a refused field's value: a worker
(protocol/openai_requests.py, on the decoded Struct) and the orchestrator
(orchestrator/relay.py, on the parsed body, before any worker sees it) both call
`refuse_unsupported`, so a refusal is the same 400 from either. A field no schema knows is
ignored, as OpenAI-compatible servers do, with one warning per field name (`UnknownFields`,
a bounded set: clients cannot grow it without limit)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable

from splitserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

IMPLEMENTED, REFUSED = "implemented", "refused"
COMPLETIONS, CHAT = "completions", "chat"
BOTH = (COMPLETIONS, CHAT)


# A refused field's accepts(value, get): get(name) is another field's value (None: unset).
def _unset(value, get) -> bool:
    return value is None


def _false(value, get) -> bool:
    return value is None or value is False


def _empty(value, get) -> bool:
    return value is None or value == [] or value == {}


def _equals(*values) -> Callable[[Any, Callable], bool]:
    def accepts(value, get) -> bool:
        return value is None or any(value == v and type(value) is type(v) for v in values)
    accepts.shown = ", ".join(["null", *(json.dumps(v) for v in values)])
    return accepts


_unset.shown, _false.shown, _empty.shown = "null", "null, false", "null, [], {}"


@dataclass(frozen=True)
class Field:
    name: str
    endpoints: tuple[str, ...]
    status: str
    what: str                     # implemented: what it does; refused: why
    # REFUSED only: (value, get) -> True when the value asks for nothing; its `shown` says
    # which values those are
    accepts: Callable[[Any, Callable], bool] = _unset

    @property
    def accepted(self) -> str:
        """The values a refused field is accepted with, as docs/api.md shows them."""
        return self.accepts.shown if self.status == REFUSED else "any valid value"


def _implemented(names: str, what: str, endpoints=BOTH) -> list[Field]:
    return [Field(n, endpoints, IMPLEMENTED, what) for n in names.split()]


def _refused(names: str, why: str, accepts=_unset, endpoints=BOTH) -> list[Field]:
    return [Field(n, endpoints, REFUSED, why, accepts) for n in names.split()]


_STRUCTURED = "not supported"
_FUNCTIONS = "the deprecated form of tools and tool_choice: send those"

FIELDS: dict[str, Field] = {f.name: f for f in [
    # OpenAI, both endpoints
    *_implemented("model", "checked against the served model's name"),
    *_implemented("n seed stop temperature top_p presence_penalty frequency_penalty "
                  "logit_bias max_tokens", "sampling and stopping"),
    *_implemented("stream", "server-sent events"),
    *_implemented("stream_options", "include_usage: a usage chunk before [DONE]; "
                  "continuous_usage_stats: usage in every chunk; include_obfuscation: only "
                  "false (no padding is sent)"),
    *_implemented("user", "session affinity routing key (splitserve up)"),
    *_implemented("logprobs", "log probabilities of the generated tokens"),
    # OpenAI, completions
    *_implemented("prompt", "the prompt: text, token ids, or a batch of either",
                  (COMPLETIONS,)),
    *_implemented("echo", "completions: the prompt before the text; chat: the last "
                  "message's content before the answer when it has the answer's role"),
    *_refused("suffix", "text after the insertion is not supported", _equals(""),
              (COMPLETIONS,)),
    *_implemented("best_of", "must equal n (no candidates beyond the returned ones)"),
    # OpenAI, chat
    *_implemented("messages", "the conversation, rendered by the model's chat template",
                  (CHAT,)),
    *_implemented("max_completion_tokens top_logprobs", "as max_tokens, logprobs", (CHAT,)),
    *_implemented("response_format", "text, json_object, or json_schema (with strict): "
                  "the answer is constrained to the schema (structured output)"),
    *_implemented("tools", "functions the model may call, rendered into the prompt by the "
                  "chat template (tool calling)", (CHAT,)),
    *_implemented("tool_choice", "none, auto (calls the answer writes are parsed into "
                  "tool_calls), required or a named function (generation constrained to "
                  "calls)", (CHAT,)),
    *_refused("functions", _FUNCTIONS, _empty, (CHAT,)),
    *_refused("function_call", _FUNCTIONS, _equals("none"), (CHAT,)),
    *_implemented("parallel_tool_calls", "false: at most one call per answer", (CHAT,)),
    *_refused("audio", "audio output is not supported", endpoints=(CHAT,)),
    *_refused("modalities", "only text output is supported", _equals(["text"]), (CHAT,)),
    *_refused("prediction", "predicted outputs are not supported", endpoints=(CHAT,)),
    *_refused("web_search_options", "web search is not supported", endpoints=(CHAT,)),
    *_refused("reasoning_effort verbosity", "the model takes no reasoning or verbosity "
              "setting", endpoints=(CHAT,)),
    *_refused("store", "completions are not stored", _false, (CHAT,)),
    *_refused("metadata", "completions are not stored, so they carry no metadata", _empty,
              (CHAT,)),
    *_refused("service_tier", "there is one service tier", _equals("auto", "default"),
              (CHAT,)),
    *_refused("prompt_cache_key safety_identifier", "not supported; `user` routes requests "
              "of one user to one worker", endpoints=(CHAT,)),
    # vLLM sampling parameters
    *_implemented("top_k min_p repetition_penalty min_tokens ignore_eos stop_token_ids "
                  "include_stop_str_in_output skip_special_tokens prompt_logprobs",
                  "sampling and stopping (vLLM)"),
    *_implemented("spaces_between_special_tokens", "byte-level BPE decoding adds no spaces "
                  "either way (vLLM's fast tokenizers do the same)"),
    *_refused("use_beam_search", "beam search is not supported", _false),
    *_refused("length_penalty", "beam search is not supported", _equals(1, 1.0)),
    *_refused("truncate_prompt_tokens", "prompts are never truncated"),
    *_refused("allowed_token_ids", "not supported; logit_bias can forbid tokens", _empty),
    *_refused("bad_words", "not supported", _empty),
    *_refused("repetition_detection", "not supported"),
    *_refused("max_repetition_pattern_size min_repetition_pattern_size repetition_min_count",
              "repetition detection is not supported", _equals(0)),
    # vLLM extra parameters
    *_implemented("add_generation_prompt continue_final_message", "how the chat template "
                  "ends the prompt (vLLM; both true is a 400)", (CHAT,)),
    *_implemented("chat_template_kwargs", "extra variables for the chat template", (CHAT,)),
    *_implemented("chat_template", "the request's own chat template, on a server started "
                  "with --trust-request-chat-template; else a 400", (CHAT,)),
    *_implemented("add_special_tokens", "special tokens (a BOS) added when the prompt is "
                  "encoded: completions by default; chat on top of the template's (vLLM)"),
    *_refused("documents", "retrieval documents are not passed to the chat template",
              endpoints=(CHAT,)),
    *_refused("mm_processor_kwargs media_io_kwargs prompt_embeds",
              "multimodal and embedding inputs are not supported", _empty),
    *_implemented("structured_outputs", "structured output (vLLM): one of json, regex, "
                  "choice, grammar (Lark or GBNF), json_object"),
    *_implemented("guided_json guided_regex guided_choice guided_grammar guided_json_object",
                  "structured output (vLLM's older names)"),
    *_refused("guided_decoding_backend", "llguidance compiles every grammar here",
              _equals("auto", "guidance", "llguidance")),
    *_refused("structural_tag guided_whitespace_pattern", _STRUCTURED),
    *_refused("priority", "requests are served in arrival order", _equals(0)),
    *_refused("request_id", "the server names each request itself"),
    *_refused("logits_processors", "custom logits processors are not supported", _empty),
    *_refused("return_tokens_as_token_ids return_token_ids", "not supported", _false),
    *_refused("kv_transfer_params", "splitserve's disaggregation is its own (splitserve up)",
              _empty),
    *_refused("vllm_xargs", "no extension reads extra arguments", _empty),
    *_refused("include_reasoning", "the model's reasoning, if any, is part of the content",
              _equals(True), (CHAT,)),
    # splitserve's own
    *_implemented("cache_salt", "prefix-cache isolation (docs/security.md)"),
    *_implemented("token_relay", "the token relay mode of this request (splitserve up)"),
    *_implemented("disaggregated_params", "set by the orchestrator, never by a client"),
]}

def field_of(name: str, endpoint: str) -> Field | None:
    """The known field of that name on that endpoint, else None."""
    f = FIELDS.get(name)
    return f if f is not None and endpoint in f.endpoints else None


def known_fields(endpoint: str) -> frozenset[str]:
    return frozenset(n for n in FIELDS if field_of(n, endpoint) is not None)


def refused_fields(endpoint: str) -> tuple[Field, ...]:
    return tuple(f for n in FIELDS if (f := field_of(n, endpoint)) and f.status == REFUSED)


def refuse_unsupported(get: Callable[[str], Any], endpoint: str) -> None:
    """InvalidRequestError (a 400 naming the field) for the first refused field whose value
    asks for something this server does not do. get(name): the request's top-level field
    as a JSON value, None if unset (a parsed body's `get`, a decoded request's attribute)."""
    for f in _REFUSED[endpoint]:
        value = get(f.name)
        if value is not None and not f.accepts(value, get):
            raise InvalidRequestError(f"{f.name} is not supported by this server: {f.what}",
                                      f.name)


def refuse_obfuscation(value) -> None:
    """stream_options.include_obfuscation (OpenAI): padding in every chunk, which this
    server never sends; false or null ask for nothing."""
    if value is not None and value is not False:
        raise InvalidRequestError("stream_options.include_obfuscation is not supported by this "
                                  "server: chunks carry no obfuscation padding",
                                  "stream_options.include_obfuscation")


def refuse_request_template(template, trusted: bool) -> None:
    """A request's own chat_template runs on the server (a sandbox, but a template may loop
    for long): only a server started with --trust-request-chat-template renders it."""
    if template is not None and not trusted:
        raise InvalidRequestError("chat_template is not accepted by this server (its "
                                  "operator may allow it with --trust-request-chat-template)",
                                  "chat_template")


class UnknownFields:
    """Warns once per field name that no schema knows (the field is ignored). At most
    `limit` names are remembered: past it, one last warning says that no more are told."""

    def __init__(self, log_prefix: str, limit: int = 256):
        self.log_prefix, self.limit = log_prefix, limit
        self.seen: set[str] = set()
        self.full = False

    def check(self, keys, endpoint: str) -> None:
        known = _KNOWN[endpoint]
        for key in keys:
            if key in known or key in self.seen or self.full:
                continue
            if len(self.seen) >= self.limit:
                self.full = True
                logger.warning("%s: %d unknown request fields were ignored; no more are "
                               "told", self.log_prefix, self.limit)
                return
            self.seen.add(key)
            logger.warning("%s: the request field %r is not one this server knows; it is "
                           "ignored", self.log_prefix, key[:64])


_KNOWN = {ep: known_fields(ep) for ep in BOTH}
_REFUSED = {ep: refused_fields(ep) for ep in BOTH}
