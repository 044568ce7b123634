"""Request: one sequence's state inside the engine core."""

from __future__ import annotations

import enum
import time

import numpy as np

from splitserve.protocol.engine import FinishReason, RemotePrefill, RequestKind
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens

__all__ = ["NO_BLOCKS", "FinishReason", "Request", "RequestStatus"]


# The block ids of a holder that has none. Holders' arrays are replaced, never written in
# place, so every empty holder can share this one.
NO_BLOCKS = np.empty(0, dtype=np.int64)


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_FORK = 1        # an n > 1 sibling: gets the leader's prompt blocks after prefill
    WAITING_FOR_REMOTE_KV = 2   # generation_only: blocks allocated, KV being pulled from CTX
    RUNNING = 3
    PREEMPTED = 4
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8
    FINISHED_HANDOFF = 9        # context_only: first token sampled, KV leased for a GEN worker

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def for_finish(reason: FinishReason) -> RequestStatus:
        return _FINISHED_STATUS[reason]


_FINISH = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.FINISHED_HANDOFF: FinishReason.HANDOFF,
}
_FINISHED_STATUS = {reason: status for status, reason in _FINISH.items()}


class Request:
    """One sequence, owned by the engine core. The scheduler changes its state (status,
    queue, computed and output tokens, forks, endings: queues.py); the block manager owns
    `block_ids` (an int64 array, replaced when it grows, never written in place); the
    sampler reads `params` and the token history."""

    def __init__(self, request_id: str, prompt: PromptTokens, params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), max_model_len: int = 1 << 30,
                 received_time: float | None = None, *, group_id: str | None = None,
                 index: int = 0, kind: RequestKind = RequestKind.AGGREGATED,
                 remote: RemotePrefill | None = None, siblings: list[Request] | None = None,
                 block_hashes: list[bytes] | None = None, resumed: list[int] | None = None,
                 hash_root: bytes = b"", grammar=None):
        """received_time: the wall clock the engine process took it off its input socket
        (default now); waiting from then on for a step to end is queue time. An n > 1
        request's sequence `index` is child `index` of `group_id`; the leader (index 0) holds
        its not-yet-forked `siblings`, which wait for it. block_hashes: a relayed prompt's,
        verified against its KV handle. resumed: output streamed by another worker before a
        migration: it counts as this sequence's output. hash_root: where its chained block
        hashes start (protocol/block_hashes.salted_root of its cache_salt; b"": none).
        grammar: its own matcher (engine/grammar.py), advanced over `resumed`; None: free text."""
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.eos_token_ids = eos_token_ids
        wall = time.time()
        # Wall clock, comparable with the front-end's: where front-end preprocessing ends.
        self.admit_time = wall if received_time is None else min(received_time, wall)
        self.arrival_time = time.monotonic() - (wall - self.admit_time)   # the same moment
        self.status = RequestStatus.WAITING_FOR_FORK if index else RequestStatus.WAITING
        self.first_scheduled_time: float | None = None   # for queue-time metrics
        self.output_token_ids: list[int] = list(resumed or ())
        self.num_resumed_tokens = len(self.output_token_ids)   # streamed before a migration
        self.num_computed_tokens = 0     # tokens whose KV is in this request's blocks
        self.num_cached_tokens = 0       # prompt tokens served from the prefix cache
        self.block_ids: np.ndarray = NO_BLOCKS
        self.block_hashes: list[bytes] = block_hashes or []   # chained, of full prompt+output blocks
        self.hash_root = hash_root
        self.grammar = grammar
        self.stop_reason: int | str | None = None  # the stop token id or string that ended it
        self.error: str | None = None
        self.group_id = request_id if group_id is None else group_id
        self.index = index
        self.siblings: list[Request] = siblings or []
        self.prompt_logprobs: list | None = None   # one entry per prompt token, first is None
        # Disaggregation: context_only hands its KV off after the first token; a request
        # with `remote` (generation_only) pulls its prompt's KV instead of computing it.
        self.context_only = kind == RequestKind.CONTEXT_ONLY
        self.remote = remote
        self.pulling = False              # a transport thread is writing into its blocks
        # A length-only prompt whose values something reads (prompt_reads.py): they come with
        # the KV pull and replace the placeholder before anything reads them; prompt_back: the
        # front-end wants them too (CompletionDelta.prompt_bytes).
        self.pull_prompt = False
        self.prompt_back = False
        self.kv_transfer_time = 0.0
        # Its stream continues elsewhere if its front-end drains (EngineRequest.movable).
        self.movable = False
        self.peer = 0                     # the front-end that submitted it
        # Output budget, clamped so prompt + output never exceeds the model's context.
        limit = max_model_len - len(prompt)
        self.max_tokens = limit if params.max_tokens is None else min(params.max_tokens, limit)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def num_remote_tokens(self) -> int:
        """generation_only: the tokens whose KV is pulled: its prompt, and a moved stream's
        resumed output but for the last token, which is decoded here next."""
        return len(self.prompt) + max(self.num_resumed_tokens - 1, 0)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH.get(self.status)

    def is_stop_token(self, token: int) -> bool:
        """EOS (unless ignore_eos) or one of params.stop_token_ids: ends it, adds no text."""
        return token in self.eos_token_ids or token in self.params.stop_token_ids

    def token_slice(self, start: int, end: int) -> np.ndarray:
        """int32 token ids at positions [start, end) of prompt + output."""
        n_prompt = len(self.prompt)
        if end <= n_prompt:
            return self.prompt.array[start:end]
        out = np.asarray(self.output_token_ids[max(start - n_prompt, 0):end - n_prompt], np.int32)
        if start >= n_prompt:
            return out
        return np.concatenate([self.prompt.array[start:], out])

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={len(self.prompt)}, "
                f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})")
