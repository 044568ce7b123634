"""DisaggregatedParams: what a request carries between a context (prefill) worker and a
generation (decode) worker. The orchestrator sets `request_type`; the CTX worker answers
with the rest, and the orchestrator relays it to the GEN worker unchanged."""

from __future__ import annotations

from typing import Literal

import msgspec

from splitserve.errors import InvalidRequestError

RequestType = Literal["context_only", "generation_only"]


class DisaggregatedParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    request_type: RequestType | None = None   # None: aggregated (prefill and decode here)
    ctx_request_id: str | None = None         # the request's id on the CTX worker
    first_gen_tokens: list[int] | None = None  # sampled by CTX after the prefill
    prompt_len: int | None = None             # prompt tokens whose KV CTX holds
    kv_handle: dict | None = None             # where and how GEN pulls the KV from CTX

    def __post_init__(self):
        _check(self.ctx_request_id is None or self.ctx_request_id != "",
               "ctx_request_id must not be empty", "ctx_request_id")
        _check(self.prompt_len is None or self.prompt_len >= 0,
               "prompt_len must be non-negative", "prompt_len")
        if self.first_gen_tokens is not None:
            _check(bool(self.first_gen_tokens), "first_gen_tokens must not be empty",
                   "first_gen_tokens")
            _check(min(self.first_gen_tokens) >= 0, "first_gen_tokens must be token ids (>= 0)",
                   "first_gen_tokens")


def _check(ok: bool, message: str, field: str) -> None:
    if not ok:
        raise InvalidRequestError(message, f"disaggregated_params.{field}")
