"""What a request carries between a context (prefill) worker and a generation (decode)
worker. The orchestrator sets `request_type`; the CTX worker answers with the rest, and the
orchestrator relays it to the GEN worker unchanged. Also the request types and token relay
modes themselves, and the SSE comment that tags a migratable stream's events."""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

from splitserve.errors import InvalidRequestError
from splitserve.protocol.engine import KVHandle, Logprob, RequestKind
from splitserve.sampling_params import INT32_MAX

MAX_FIRST_GEN_TOKENS = 16     # a context worker samples one; room for speculative drafts
MAX_ID_LEN = 256              # characters of ctx_request_id
MAX_TOP = 20                  # alternatives per logprob entry (SamplingParams' limit)

RequestType = Literal["context_only", "generation_only"]
# What each request_type asks of the engine (None: aggregated, prefill and decode here).
REQUEST_KIND = {None: RequestKind.AGGREGATED, "context_only": RequestKind.CONTEXT_ONLY,
                "generation_only": RequestKind.GENERATION_ONLY}
# How the prompt travels CTX -> orchestrator -> GEN: as JSON ids, as base64 int32, or only
# its length (its KV, and its ids if something reads them, come with the KV pull).
TokenRelay = Literal["list", "b64", "metadata"]
TOKEN_RELAYS: tuple[str, ...] = get_args(TokenRelay)
# What a cluster (or a request's token_relay) may ask for: auto is the orchestrator's
# choice, metadata (orchestrator/relay.py).
RELAY_MODES = (*TOKEN_RELAYS, "auto")
# stream_token_ids: the SSE comment line before each event, naming its token ids.
IDS_COMMENT = b": ids "
# A draining generation worker ends a stream_token_ids stream with this comment (and no
# [DONE]): the generation_only disaggregated_params (JSON) that continue it elsewhere.
HANDOFF_COMMENT = b": handoff "


class DisaggregatedParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    request_type: RequestType | None = None   # None: aggregated (prefill and decode here)
    ctx_request_id: str | None = None         # the request's id on the CTX worker
    first_gen_tokens: list[int] | None = None  # sampled by CTX after the prefill
    first_gen_logprobs: list[Logprob] | None = None
    prompt_len: int | None = None             # prompt tokens whose KV CTX holds
    kv_handle: KVHandle | None = None         # where and how GEN pulls the KV from CTX
    # How the prompt travels CTX -> orchestrator -> GEN (context_only: what to answer with).
    token_relay: TokenRelay | None = None
    prompt_token_ids: list[int] | None = None  # list: the prompt as JSON ints
    prompt_token_ids_b64: str | None = None    # b64: little-endian int32, base64
    # Mid-stream migration (orchestrator/migrate.py). stream_token_ids: tag each SSE event
    # with the token ids it carries, as a comment line (`: ids 1 2 3`) the orchestrator
    # strips; resume_token_ids: output already streamed from a worker that failed or
    # drained; this request continues after it (aggregated: recomputing it with the prompt;
    # generation_only: pulling its KV, all but the last token's, from the draining worker).
    stream_token_ids: bool | None = None
    resume_token_ids: list[int] | None = None
    # context_only: the client's request streams (its GEN answers in SSE), so the bound on
    # a response built whole does not apply (protocol/logprob_bound.py).
    client_stream: bool | None = None

    def __post_init__(self):
        _check(self.ctx_request_id is None or 0 < len(self.ctx_request_id) <= MAX_ID_LEN,
               f"ctx_request_id must be 1 to {MAX_ID_LEN} characters long", "ctx_request_id")
        _check(self.prompt_len is None or 0 <= self.prompt_len <= INT32_MAX,
               f"prompt_len must be between 0 and {INT32_MAX}", "prompt_len")
        if self.first_gen_tokens is not None:
            _check(0 < len(self.first_gen_tokens) <= MAX_FIRST_GEN_TOKENS,
                   f"first_gen_tokens must hold 1 to {MAX_FIRST_GEN_TOKENS} tokens",
                   "first_gen_tokens")
            _check_ids(self.first_gen_tokens, "first_gen_tokens")
        if self.first_gen_logprobs is not None:
            _check_logprobs(self.first_gen_logprobs, len(self.first_gen_tokens or ()))
        if self.prompt_token_ids:
            _check_ids(self.prompt_token_ids, "prompt_token_ids")
        if self.resume_token_ids:
            _check_ids(self.resume_token_ids, "resume_token_ids")

    def check_resume(self) -> None:
        _check(self.request_type != "context_only", "resume_token_ids is for an aggregated "
               "or generation_only request", "resume_token_ids")
        _check(bool(self.resume_token_ids), "resume_token_ids must not be empty",
               "resume_token_ids")

    def check_generation_only(self) -> None:
        """A generation_only request must say where its KV is and what came first (the
        context worker's first tokens, or a moved stream's resumed output: the handle holds
        the KV of all but its last token)."""
        first = "resume_token_ids" if self.resume_token_ids else "first_gen_tokens"
        for name in ("kv_handle", first, "prompt_len"):
            _check(getattr(self, name) is not None, f"{name} is required for generation_only", name)
        _check(self.prompt_token_ids is None or self.prompt_token_ids_b64 is None,
               "send prompt_token_ids or prompt_token_ids_b64, not both", "prompt_token_ids")
        held = self.prompt_len + max(len(self.resume_token_ids or ()) - 1, 0)
        _check(held == self.kv_handle.num_tokens,
               f"prompt_len {self.prompt_len} (and resume_token_ids) disagree with the KV "
               f"handle's {self.kv_handle.num_tokens} tokens", "prompt_len")


def relayed_handle(handle: KVHandle, relay: str | None) -> KVHandle:
    """The KV handle a context worker answers with: the prompt's block hashes only for a
    length-only relay (a GEN given the tokens computes them itself; so list and b64 bodies do
    not grow by 16 bytes a block)."""
    if relay == "metadata" or not handle.block_hashes:
        return handle
    return msgspec.structs.replace(handle, block_hashes=b"")


def ids_comment(token_ids: list[int]) -> bytes:
    """The comment naming the tokens of the SSE event after it: clients ignore comments;
    the orchestrator reads and strips them to migrate a broken stream."""
    return IDS_COMMENT + " ".join(map(str, token_ids)).encode() + b"\n\n"


def handoff_comment(params: DisaggregatedParams) -> bytes:
    """The last event of a stream handed off by a draining worker: params without the
    resumed tokens (the orchestrator has them from the ids comments)."""
    return HANDOFF_COMMENT + msgspec.json.encode(params) + b"\n\n"


def comment_ids(event: bytes) -> list[int]:
    """The token ids of an IDS_COMMENT event (without its blank line); ValueError if they
    are not numbers."""
    return [int(t) for t in event[len(IDS_COMMENT):].split()]


def _check_ids(ids: list[int], name: str) -> None:
    _check(0 <= min(ids) and max(ids) <= INT32_MAX,
           f"{name} must be token ids (0 to {INT32_MAX})", name)


def _check_logprobs(entries: list[Logprob], num_tokens: int) -> None:
    """They are relayed back to the client as they came: one per first token, int32 ids."""
    name = "first_gen_logprobs"
    _check(len(entries) == num_tokens, f"{name} must have one entry per first_gen_tokens", name)
    for lp in entries:
        _check(len(lp.top) <= MAX_TOP, f"{name} entries hold at most {MAX_TOP} alternatives", name)
        ids = [lp.token_id, lp.rank, *(t for t, _ in lp.top)]
        _check(0 <= min(ids) and max(ids) <= INT32_MAX, f"{name} holds ids or ranks outside "
               f"0 to {INT32_MAX}", name)


def _check(ok: bool, message: str, field: str) -> None:
    if not ok:
        raise InvalidRequestError(message, f"disaggregated_params.{field}")
