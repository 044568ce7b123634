"""Messages between a worker's front-end and its engine-core process (ZeroMQ, msgpack).

Prompt token ids never ride inside these Structs: an AddRequest is followed by one raw
little-endian int32 frame (empty for a length-only placeholder)."""

from __future__ import annotations

import msgspec

from splitserve.sampling_params import SamplingParams


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
    queue_time: float = 0.0                              # seconds waiting before first scheduled
    error: str | None = None
    error_param: str | None = None                       # set when the engine rejected the input


# -- front-end -> engine core ----------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    params: SamplingParams
    prompt_len: int
    placeholder: bool = False          # length-only prompt: no token frame values
    arrival_time: float = 0.0          # time.time() when the front-end received the request


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


EngineInput = AddRequest | AbortRequests | Shutdown


# -- engine core -> front-end ----------------------------------------------------------------
class EngineStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int


class EngineReady(msgspec.Struct, tag="ready"):
    model_name: str
    dtype: str
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int


class EngineOutputs(msgspec.Struct, tag="outputs"):
    deltas: list[CompletionDelta]
    stats: EngineStats


class EngineDead(msgspec.Struct, tag="dead"):
    reason: str


EngineOutput = EngineReady | EngineOutputs | EngineDead
