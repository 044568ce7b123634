"""What the orchestrator sends each worker for one client request, as pure functions of the
client's body (decoded once, never modified): the CTX request, the GEN request built from
CTX's answer per the token relay mode, and a finished CTX answer as SSE. No I/O here:
pools.py picks and tries the workers, stream.py passes GEN's response bytes through.
"""

from __future__ import annotations

import orjson

from splitserve.errors import InvalidRequestError
from splitserve.protocol.grammar import grammar_spec
from splitserve.protocol.cache_salt import check_cache_salt
from splitserve.protocol.disagg import RELAY_MODES
from splitserve.protocol.logprob_bound import check_generation_logprobs
from splitserve.protocol.tools import check_tools
from splitserve.protocol.openai_fields import (
    CHAT, COMPLETIONS, UnknownFields, refuse_obfuscation, refuse_request_template,
    refuse_unsupported)
from splitserve.protocol.openai_requests import (
    STREAM_OPTIONS_NEED_STREAM, decode_chat_request, decode_completion_request)

SSE = "text/event-stream"


class UpstreamError(Exception):
    """The cluster could not serve the request; the message is for the client."""

    def __init__(self, message: str, status: int = 503, retry_after: float | None = 1.0):
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


def needs_aggregated(body: dict) -> bool:
    """Requests the split path does not serve: they run whole on a generation worker.
    Prompt logprobs (GEN does not prefill), and n > 1 (siblings fork from one prefill) in a
    body that was not split into single choices (the orchestrator splits them: split.py)."""
    n = body.get("n")   # not an int: the worker's 400 names it
    return ((isinstance(n, int) and n > 1) or body.get("prompt_logprobs") is not None
            or (bool(body.get("echo")) and body.get("logprobs") is not None))


def prefix_key(body: dict) -> bytes:
    """The first bytes of the prompt: what prefix_aware routing groups by."""
    prompt = body.get("prompt")
    if prompt is None:
        messages = body.get("messages")
        messages = messages if isinstance(messages, list) else []
        prompt = [m.get("content") for m in messages if isinstance(m, dict)]
    return orjson.dumps(prompt)[:256]


def parse_body(raw: bytes) -> dict:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidRequestError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    # orjson reads 1024 levels of nesting but writes 254, and the body is written again for
    # each worker. Only a body with that many brackets can be that deep: the rest skip this.
    if raw.count(b"[") + raw.count(b"{") > _MAX_DUMPS_DEPTH:
        try:
            orjson.dumps(body)
        except TypeError:
            raise InvalidRequestError(f"the request body nests deeper than {_MAX_DUMPS_DEPTH} "
                                      f"levels") from None
    dp = body.get("disaggregated_params")
    if dp is not None:
        raise InvalidRequestError("disaggregated_params is set by the orchestrator, not the client",
                                  "disaggregated_params")
    _check_stream_fields(body)
    check_cache_salt(body.get("cache_salt"))
    return body


def check_fields(body: dict, chat: bool, unknown: UnknownFields,
                 trust_templates: bool = False) -> None:
    """The workers' refusals of what this server does not do (protocol/openai_fields.py),
    the same 400 before any worker sees the request; unknown fields are told to `unknown`.
    trust_templates: the cluster's --trust-request-chat-template."""
    endpoint = CHAT if chat else COMPLETIONS
    refuse_unsupported(body.get, endpoint)
    grammar_spec(body.get)   # its shape; whether it compiles, the worker's tokenizer says
    if chat:
        refuse_request_template(body.get("chat_template"), trust_templates)
        check_tools(body.get)   # shapes and bounds; whether schemas compile, the worker says
    unknown.check(body, endpoint)


def salted(body: dict, salt: str | None) -> dict:
    """The client's body with the effective cache_salt (protocol/cache_salt.py) in place of
    its own: what every worker is sent, and what the orchestrator's block hashes start
    from. Internal requests, so the workers take the salt as it is."""
    if salt == body.get("cache_salt"):
        return body
    return {**body, "cache_salt": salt}


def _check_stream_fields(body: dict) -> None:
    """The context worker never sees stream and stream_options (context_body drops them):
    when it ends a request itself, the orchestrator answers per these two, so it checks them."""
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequestError("stream must be a boolean", "stream")
    if options is not None and not (isinstance(options, dict) and all(isinstance(
            options.get(k), (bool, type(None))) for k in ("include_usage",
                                                           "continuous_usage_stats"))):
        raise InvalidRequestError("stream_options must be an object whose include_usage and "
                                  "continuous_usage_stats are booleans", "stream_options")
    if options is not None and stream is not True:
        raise InvalidRequestError(STREAM_OPTIONS_NEED_STREAM, "stream_options")
    if options is not None:
        refuse_obfuscation(options.get("include_obfuscation"))


_MAX_DUMPS_DEPTH = 254


def check_logprobs(raw: bytes, body: dict, chat: bool) -> None:
    """A response's generation logprobs past the workers' bound (protocol/logprob_bound.py):
    the same 400 a worker would answer, before any worker sees the request, when the body
    shows the count: its max_tokens. Without one a worker counts what its context leaves
    after the prompt, which only it knows (max_model_len, the prompt's tokens): the context
    worker refuses it then, before its prefill. Only a body asking for logprobs is decoded
    again, as a worker decodes it (a bad field is a 400 naming it, as there)."""
    logprobs = body.get("logprobs")
    if logprobs is None or logprobs is False or body.get("stream") is True:
        return
    req = decode_chat_request(raw) if chat else decode_completion_request(raw)
    params = req.sampling_params()
    if params.max_tokens is not None:
        prompts = 1 if chat else len(req.prompts())
        check_generation_logprobs(req, params.n, params.logprobs, [params.max_tokens] * prompts)


def relay_mode(body: dict, default: str) -> str:
    """list | b64 | metadata for this request. `token_relay` in the body overrides the
    cluster's mode (for testing and measurement). auto: length only, always: whatever reads
    prompt token values on the generation worker (penalties, echo) gets them with the KV
    (engine/prompt_reads.py); prompt logprobs run aggregated (needs_aggregated)."""
    mode = body.get("token_relay") or default
    if mode not in RELAY_MODES:
        raise InvalidRequestError(f"token_relay must be one of {', '.join(RELAY_MODES)}",
                                  "token_relay")
    return "metadata" if mode == "auto" else mode


def context_body(body: dict, mode: str) -> dict:
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "token_relay")}
    out["stream"] = False
    out["disaggregated_params"] = {"request_type": "context_only", "token_relay": mode}
    if body.get("stream") is True:     # GEN streams: no bound on a whole body's logprobs
        out["disaggregated_params"]["client_stream"] = True
    return out


def generation_body(body: dict, ctx_params: dict, migratable: bool = False) -> dict:
    """The client's request minus its prompt (GEN takes the prompt from ctx_params, in the
    relay mode's form; a token-id prompt must not cost GEN a JSON list decode anyway), but
    for a chat echo's messages (the answer starts with the last one's content).
    migratable: GEN tags its SSE events with their token ids (orchestrator/migrate.py)."""
    dropped = ("prompt", "token_relay") if _chat_echo(body) else \
        ("prompt", "messages", "token_relay")
    out = {k: v for k, v in body.items() if k not in dropped}
    out["disaggregated_params"] = {**ctx_params, "request_type": "generation_only"}
    if migratable:
        out["disaggregated_params"]["stream_token_ids"] = True
    return out


def _chat_echo(body: dict) -> bool:
    return body.get("echo") is True and "messages" in body


def as_stream(answer: dict, include_usage: bool, continuous_usage: bool = False) -> bytes:
    """A finished non-streaming answer (CTX ended the request) as the SSE a client expects;
    continuous_usage: every chunk carries the usage (vLLM), here the answer's whole."""
    chat = answer.get("object") == "chat.completion"
    head = {k: answer[k] for k in ("id", "created", "model") if k in answer}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    out = []
    for c in answer.get("choices", []):
        if chat:
            msg = c.get("message") or {}
            delta = {"role": "assistant", "content": msg.get("content")}
            if msg.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call}
                                       for i, call in enumerate(msg["tool_calls"])]
            choice = {"index": c["index"], "delta": delta,
                      "logprobs": c.get("logprobs"), "finish_reason": c.get("finish_reason")}
        else:
            choice = {"index": c["index"], "text": c.get("text", ""), "logprobs": c.get("logprobs"),
                      "finish_reason": c.get("finish_reason")}
        usage = {"usage": answer["usage"]} if continuous_usage and "usage" in answer else {}
        out.append(b"data: " + orjson.dumps({**head, "choices": [choice], **usage}) + b"\n\n")
    if include_usage and "usage" in answer:
        out.append(b"data: " + orjson.dumps({**head, "choices": [], "usage": answer["usage"]}) + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)
