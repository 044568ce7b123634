"""Messages between a worker's front-end and its engine-core process (ZeroMQ, msgpack).

Prompt token ids never ride inside the encoded Structs: every message to the engine travels
as one ZeroMQ frame (pack_input): the encoded message, then, for AddRequests, the raw
little-endian int32 token ids of its requests (a length-only placeholder prompt sends none),
back to back.

The per-request Structs (EngineRequest excepted: it holds its tokens) are gc=False: they
hold plain data and never take part in a reference cycle, so the garbage collector need not
walk the thousands that requests in flight keep alive. (With 1024 requests held decoding,
its full passes stalled the front-end's event loop for ~86 ms; this and the engine's
final-only output for responses sent whole brought them to ~20 ms.)"""

from __future__ import annotations

import enum

import msgspec

from splitserve.errors import InvalidRequestError
from splitserve.protocol.block_hashes import HASH_BYTES
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens


class Logprob(msgspec.Struct, array_like=True, gc=False):
    token_id: int
    logprob: float
    rank: int
    # A tuple of tuples of numbers, not a list: the garbage collector stops tracking such
    # tuples once its passes have seen them (the pairs, then the tuple of them), so a
    # front-end holding a response's logprobs (2^20 entries at the bound) costs its full
    # passes nothing; as lists, 50,000 of them made each full pass walk a million items:
    # 85-335 ms of the event loop.
    top: tuple[tuple[int, float], ...]


_MAX_HANDLE_STR = 1024


class KVHandle(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """Where a GEN worker pulls a context request's KV from."""
    backend: str                 # "tcp" | "nixl" | "none": a name in kv/__init__.py
    endpoint: str                # the CTX engine's KV server
    ctx_request_id: str
    layout: str                  # kv.base.layout_fingerprint() of the CTX engine
    num_tokens: int              # tokens whose KV is held: the prompt (a moved stream's:
                                 # its prompt and all but its last output token)
    agent_metadata: bytes = b""  # backend extra (nixl agent metadata)
    lease_token: str = ""        # the CTX's per-lease secret: only its holder may pull and ack
    # block_hashes.prompt_digest of the prompt whose KV is held (hex): a GEN given the prompt's
    # tokens checks they are that prompt's before it pulls or caches anything.
    prompt_digest: str = ""
    # The chained hashes (block_hashes.chain_hashes, HASH_BYTES each, concatenated;
    # base64 in JSON) of the prompt's full blocks: a GEN given only the prompt's length looks
    # them up in its prefix cache and pulls only the blocks it lacks. Trusted as far as the
    # peer that sent them (docs/security.md).
    block_hashes: bytes = b""

    def __post_init__(self):
        _check(0 <= self.num_tokens < 2**31, "kv_handle.num_tokens must be between 0 and 2^31-1")
        _check(len(self.block_hashes) % HASH_BYTES == 0 and
               len(self.block_hashes) <= HASH_BYTES * self.num_tokens,
               f"kv_handle.block_hashes must be {HASH_BYTES}-byte hashes, at most one per token")
        _check(bool(self.endpoint) and bool(self.ctx_request_id),
               "kv_handle needs an endpoint and a ctx_request_id")
        _check(max(len(self.endpoint), len(self.ctx_request_id), len(self.layout),
                   len(self.backend), len(self.lease_token),
                   len(self.prompt_digest)) <= _MAX_HANDLE_STR,
               f"kv_handle's strings must be at most {_MAX_HANDLE_STR} characters long")


class RemotePrefill(msgspec.Struct, omit_defaults=True, gc=False):
    """generation_only: the prompt's KV is on a context worker; CTX sampled first_gen_tokens.
    A stream moved off a draining generation worker has none: its resumed output is in the
    handle's KV but for its last token, which it decodes next."""
    handle: KVHandle
    first_gen_tokens: list[int]
    first_gen_logprobs: list[Logprob] | None = None


class CompletionDelta(msgspec.Struct, omit_defaults=True, gc=False):
    """What one output sequence gained in one engine step. `index` is the sequence's place
    among the request's n outputs; the request is finished when finish_reason is set."""
    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None   # only in a sequence's first delta
    finish_reason: int | None = None                     # FinishReason
    stop_reason: int | str | None = None                 # the stop token id or string
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queue_time: float = 0.0                              # seconds waiting before first scheduled
    prefill_time: float = 0.0                            # first scheduled to first token
    error: str | None = None
    error_param: str | None = None                       # set when the engine rejected the input
    kv_handle: KVHandle | None = None                    # context_only: KV left for a GEN to pull
    kv_transfer_time: float = 0.0                        # generation_only: seconds to pull the KV
    # generation_only with prompt_back: the prompt's int32 token ids (little-endian), which
    # came with its KV, in the sequence's first delta; never a list.
    prompt_bytes: bytes = b""
    admit_time: float = 0.0                              # wall clock the engine process received it
    first_token_time: float = 0.0                        # stream=False only: wall clock of token 1
    received: float = 0.0     # front-end only: wall clock its EngineOutputs arrived (not sent)


# -- front-end -> engine core ----------------------------------------------------------------
class RequestKind(enum.IntEnum):
    AGGREGATED = 0        # prefill and decode here
    CONTEXT_ONLY = 1      # prefill, sample one token, lease the KV for a generation worker
    GENERATION_ONLY = 2   # pull the prompt's KV from a context worker (remote), then decode


class FinishReason(enum.IntEnum):
    """CompletionDelta.finish_reason."""
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    HANDOFF = 4                 # continues on a generation worker (its KV leased)

    def __str__(self) -> str:
        return self.name.lower()


class EngineRequest(msgspec.Struct, kw_only=True, dict=True):
    """One request as the front-end built it (build(), the one place, used by the front-end,
    `LLM` and `bench engine`), checked, and the engine takes it: the engine builds its
    Request(s) from this.

    Its token ids belong to it in-process (`prompt`, `resumed`) but never ride inside the
    encoded message: they cross the wire as the int32 bytes after it (token_bytes(),
    pack_input) and the engine's input thread cuts them back out (take_tokens()). They live
    in the instance's __dict__ (dict=True), which msgspec never encodes. (msgspec allows a
    __dict__ only with gc tracking: unlike the other per-request Structs here, one that
    holds its prompt is tracked; a request in flight keeps one.)"""
    request_id: str
    params: SamplingParams
    prompt_len: int
    placeholder: bool = False          # length-only prompt: no token frame values
    kind: RequestKind = RequestKind.AGGREGATED
    remote: RemotePrefill | None = None   # GENERATION_ONLY: where the KV is, the first tokens
    stream: bool = True                # False: one delta per sequence, when it finishes
    # Mid-stream migration: output a response already streamed from another worker; its
    # tokens ride after the prompt's and the request continues after them.
    num_resumed: int = 0
    # A length-only prompt whose values the front-end needs (echo): the engine pulls them
    # with the KV and hands them back in the first delta (CompletionDelta.prompt_bytes).
    prompt_back: bool = False
    # block_hashes.salted_root of the request's effective cache_salt (b"": none):
    # where its chained block hashes start. The salt itself never reaches the engine.
    hash_root: bytes = b""
    # A stream the orchestrator can continue elsewhere (it tags events with their ids): a
    # draining engine hands it off with its KV leased instead of decoding it to the end.
    movable: bool = False

    # In-process only, never encoded (class defaults until an instance sets its own).
    prompt = None      # PromptTokens (a placeholder for a length-only prompt); None in the
                       # engine when its frame's bytes did not add up
    resumed = None     # PromptTokens: the num_resumed output tokens, or None
    received = None    # engine: wall clock its input thread took it in (None: now)
    peer = 0           # engine: the front-end that sent it (AddRequests.peer)

    def __post_init__(self):
        if (self.kind == RequestKind.GENERATION_ONLY) != (self.remote is not None):
            raise InvalidRequestError("a generation_only request, and only one, carries the "
                                      "context worker's KV handle", "disaggregated_params")
        if len(self.hash_root) not in (0, HASH_BYTES):
            raise InvalidRequestError(f"hash_root must be empty or {HASH_BYTES} bytes",
                                      "cache_salt")

    @classmethod
    def build(cls, request_id: str, prompt: PromptTokens, params: SamplingParams, *,
              kind: RequestKind = RequestKind.AGGREGATED, remote: RemotePrefill | None = None,
              stream: bool = True, resumed: PromptTokens | None = None,
              prompt_back: bool = False, hash_root: bytes = b"",
              movable: bool = False) -> EngineRequest:
        """The request with its tokens; the lengths the message declares are theirs, so
        the frame always adds up."""
        request = cls(request_id=request_id, params=params, prompt_len=len(prompt),
                      placeholder=prompt.is_placeholder, kind=kind, remote=remote,
                      stream=stream, num_resumed=0 if resumed is None else len(resumed),
                      prompt_back=prompt_back, hash_root=hash_root, movable=movable)
        request.prompt, request.resumed = prompt, resumed
        return request

    def token_bytes(self) -> memoryview | bytes:
        """What follows the message in its frame: the prompt's int32 bytes (none for a
        placeholder), then the resumed output's. Zero-copy unless there is resumed output."""
        frame = b"" if self.placeholder else memoryview(self.prompt.array).cast("B")
        if self.resumed is not None:
            frame = bytes(frame) + memoryview(self.resumed.array).cast("B")
        return frame

    def take_tokens(self, frame: memoryview | None, received: float, peer: int = 0) -> None:
        """The engine's input thread: its tokens from the bytes split_prompts cut for it
        (None when its batch's bytes did not add up: `prompt` stays None, and the engine
        refuses it), with when and from which front-end it came."""
        self.received, self.peer = received, peer
        if frame is None:
            return
        tokens = PromptTokens.from_bytes(frame).array
        self.prompt = (PromptTokens.placeholder(self.prompt_len) if self.placeholder
                       else PromptTokens(tokens[:self.prompt_len]))
        if self.num_resumed:
            self.resumed = PromptTokens(tokens[len(tokens) - self.num_resumed:])

    @property
    def num_tokens(self) -> int:
        """Token ids in its frame: the prompt's (none for a placeholder), then the resumed."""
        return (0 if self.placeholder else self.prompt_len) + self.num_resumed

    @property
    def disaggregated(self) -> bool:
        return self.kind != RequestKind.AGGREGATED


class AddRequests(msgspec.Struct, tag="add", omit_defaults=True):
    """Every request the front-end submitted in one event-loop turn, in one message: one
    ZeroMQ send per turn instead of one per request (pack_input). `peer`: which of the
    engine's front-ends sent it (the one its outputs go back to; server/frontends.py)."""
    requests: list[EngineRequest]
    peer: int = 0


def pack_input(header: bytes, prompts=()) -> bytes:
    """One frame: the encoded message's length (4 bytes, little-endian), the message, and
    each non-placeholder request's int32 prompt bytes in order. One frame, not one per
    prompt: the engine's reader thread waits for the GIL once per frame it receives, up to
    a switch interval each while a step runs Python."""
    return b"".join([len(header).to_bytes(4, "little"), header, *prompts])


def unpack_input(buf: memoryview) -> tuple[memoryview, memoryview]:
    """(the message to decode, the prompt bytes after it) of a pack_input frame."""
    n = int.from_bytes(buf[:4], "little")
    return buf[4:4 + n], buf[4 + n:]


def split_prompts(requests: list[EngineRequest], body: memoryview) -> list[memoryview | None]:
    """Each request's token bytes (its prompt's, then its resumed output's); None for all of
    them when the bytes do not add up to the declared lengths (the batch was built wrong)."""
    out, offset = [], 0
    for req in requests:
        size = 4 * req.num_tokens
        if req.prompt_len < 0 or size < 0 or offset + size > len(body):
            return [None] * len(requests)
        out.append(body[offset:offset + size])
        offset += size
    return out if offset == len(body) else [None] * len(requests)


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Drain(msgspec.Struct, tag="drain"):
    """Front-end `peer` is stopping: from the next step on, each of its movable streams that
    is decoding ends with a HANDOFF delta, its KV leased for the generation worker that
    continues it. Until PeerGone(peer): a front-end started in its place serves anew."""
    peer: int = 0


class PeerGone(msgspec.Struct, tag="gone"):
    """From the process that owns the engine: front-end `peer` died; abort its requests
    (so their KV blocks are freed): a restarted front-end starts with none."""
    peer: int


EngineInput = AddRequests | AbortRequests | Shutdown | PeerGone | Drain


class NamedRequest(msgspec.Struct, gc=False):
    """The fields of an EngineRequest that say which request it is and how many token bytes
    follow: what can still be read of one that fails to decode."""
    request_id: str
    prompt_len: int = 0
    placeholder: bool = False
    num_resumed: int = 0

    num_tokens = EngineRequest.num_tokens


class _RawRequests(msgspec.Struct, tag="add"):
    requests: list[msgspec.Raw]


_raw_requests = msgspec.msgpack.Decoder(_RawRequests)
_engine_request = msgspec.msgpack.Decoder(EngineRequest)
_named_request = msgspec.msgpack.Decoder(NamedRequest)


def decode_leniently(header: bytes | memoryview,
                     ) -> list[tuple[NamedRequest, EngineRequest | msgspec.DecodeError]]:
    """An AddRequests message that failed to decode, read one request at a time: each that
    decodes, or the name of each that does not with its error. Requests that do not even
    name themselves are left out. [] if it is no AddRequests at all."""
    try:
        raws = _raw_requests.decode(header).requests
    except msgspec.DecodeError:
        return []
    out = []
    for raw in raws:
        try:
            named = _named_request.decode(raw)
        except msgspec.DecodeError:
            continue
        try:
            out.append((named, _engine_request.decode(raw)))
        except msgspec.DecodeError as exc:
            out.append((named, exc))
    return out


# -- engine core -> front-end ----------------------------------------------------------------
class EngineStats(msgspec.Struct, array_like=True, gc=False):
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_blocks_leased: int = 0          # held for generation workers to pull
    steps: int = 0                     # engine steps completed (liveness: sent at least
                                       # every half second, after a step, changed or not)
    kv_error: str = ""                 # the KV transport's health(): what stopped, "" if fine
    kv_bytes_pulled: int = 0           # generation_only: KV bytes pulled from context workers
    kv_blocks_pulled: int = 0
    kv_blocks_reused: int = 0          # prompt blocks found in this worker's prefix cache instead
    num_prefill_tokens: int = 0        # prompt tokens still to compute (queues.py)


class EngineReady(msgspec.Struct, tag="ready"):
    model_name: str
    dtype: str
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    kv_endpoint: str = ""
    layout: str = ""                   # kv.base.layout_fingerprint() of its KV cache


class EngineOutputs(msgspec.Struct, tag="outputs"):
    deltas: list[CompletionDelta]
    stats: EngineStats


class KVBlocks(msgspec.Struct, tag="kv_blocks"):
    """The chained hashes (block_hashes.chain_hashes) of the blocks in the engine's
    prefix cache, for a KV-aware router: sent when they changed, at most about once a second.
    version: names this snapshot; it changes (and only then) when the cache did, and differs
    across engine restarts. hashes: 16 bytes each, back to back, the newest `limit` of
    `total` (engine/kv_report.py)."""
    version: str
    block_size: int
    total: int
    hashes: bytes


class EngineDead(msgspec.Struct, tag="dead"):
    reason: str


EngineOutput = EngineReady | EngineOutputs | KVBlocks | EngineDead


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message, "disaggregated_params.kv_handle")
