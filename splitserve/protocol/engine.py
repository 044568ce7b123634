"""Messages from the engine core to its clients (in-process or over ZeroMQ)."""

from __future__ import annotations

import msgspec


class Logprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


class CompletionDelta(msgspec.Struct, omit_defaults=True):
    """What one output sequence gained in one engine step. `index` is the sequence's place
    among the request's n outputs; the request is finished when finish_reason is set."""
    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None   # only in a sequence's first delta
    finish_reason: int | None = None                     # engine.request.FinishReason
    stop_reason: int | str | None = None                 # the stop token id or string
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
