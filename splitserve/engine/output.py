"""How EngineCore turns sampled tokens into CompletionDeltas: stop checks and the
incremental detokenizer, final-only merging (a response sent whole gets one delta per
sequence), finishing a request, and forking an n > 1 request's siblings from its leader.
Every method runs on the engine thread.
"""

from __future__ import annotations

import time

from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.engine.request import FinishReason, Request, RequestStatus
from splitserve.protocol.engine import CompletionDelta


class OutputBuilder:
    """Owns each sequence's detokenizer and, for a sequence whose response is sent whole
    (stream=False), the delta it holds until it finishes. Given the engine's scheduler (a
    finished sequence leaves it, a forked one joins it), block manager and runner (a fork
    shares or copies the leader's blocks), remote KV (a context_only request's KV is leased
    after its first token) and the engine's groups, from which it drops a finished group."""

    def __init__(self, tokenizer, scheduler, block_manager, runner, remote_kv,
                 groups: dict[str, list[Request]]):
        self.tokenizer, self.scheduler, self.block_manager = tokenizer, scheduler, block_manager
        self.runner, self.remote_kv, self.groups = runner, remote_kv, groups
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}   # by id(request)
        # Sequences sent whole: their deltas merge here and leave once, when the sequence
        # finishes, not once per step. None until the first token.
        self.final_only: dict[int, CompletionDelta | None] = {}

    def send_whole(self, req: Request) -> None:
        self.final_only[id(req)] = None

    def forget(self, req: Request) -> None:
        """Drop what is held for a request taken out without finishing."""
        self.final_only.pop(id(req), None)
        self.detokenizers.pop(id(req), None)

    def fork(self, leader: Request, sib: Request) -> bool:
        """n > 1: a sibling shares the leader's prompt blocks and samples from its logits;
        False (it waits to recompute instead) when no block is free for it."""
        if self.block_manager.num_free_blocks < 1:
            sib.status = RequestStatus.WAITING    # no room to fork: recompute (prefix cache helps)
            self.scheduler.add(sib)
            return False
        copy = self.block_manager.fork(leader, sib)
        if copy is not None:
            self.runner.copy_block(*copy)
        sib.num_computed_tokens = leader.num_computed_tokens
        sib.prompt_logprobs = leader.prompt_logprobs
        sib.status = RequestStatus.RUNNING
        self.scheduler.running.append(sib)
        return True

    def append_token(self, req: Request, token: int, logprob, out: list[CompletionDelta]) -> None:
        first = req.num_output_tokens == req.num_resumed_tokens
        req.output_token_ids.append(token)
        delta = CompletionDelta(req.group_id, req.index, [token], "",
                                logprobs=None if logprob is None else [logprob])
        if first:
            delta.prompt_logprobs = req.prompt_logprobs
            delta.num_prompt_tokens = req.num_prompt_tokens
            delta.num_cached_tokens = req.num_cached_tokens
            if req.first_scheduled_time is not None:
                delta.queue_time = req.first_scheduled_time - req.arrival_time
                delta.prefill_time = time.monotonic() - req.first_scheduled_time
            delta.kv_transfer_time = req.kv_transfer_time
            delta.admit_time = req.admit_time
            if req.prompt_back:   # its values came with the KV: the front-end echoes them
                delta.prompt_bytes = req.prompt.tobytes()
            if id(req) in self.final_only:
                delta.first_token_time = time.time()   # its TTFT: no delta leaves now
        reason = self._check_stop(req, token, delta)
        if reason is None and req.context_only:
            delta.kv_handle = self.remote_kv.lease(req)
            reason = FinishReason.HANDOFF
        if reason is not None:
            self.finish(req, reason, out, delta)
        elif id(req) not in self.final_only:
            out.append(delta)
        else:
            self._hold(req, delta)

    def _hold(self, req: Request, delta: CompletionDelta) -> CompletionDelta:
        """Merge a final-only sequence's delta into what it holds; returns the merged one."""
        held = self.final_only[id(req)]
        if held is None:
            self.final_only[id(req)] = delta
            return delta
        held.token_ids += delta.token_ids
        held.text += delta.text
        if delta.logprobs is not None:
            if held.logprobs is None:
                held.logprobs = []
            held.logprobs += delta.logprobs
        return held

    def _check_stop(self, req: Request, token: int, delta: CompletionDelta) -> FinishReason | None:
        params = req.params
        if token in req.eos_token_ids:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            req.stop_reason = token
            return FinishReason.STOP
        text, stop = self.detokenizer(req).step([token])
        delta.text = text
        if stop is not None:
            req.stop_reason = stop
            return FinishReason.STOP
        if req.num_output_tokens >= req.max_tokens:
            return FinishReason.LENGTH
        return None

    def detokenizer(self, req: Request) -> IncrementalDetokenizer:
        d = self.detokenizers.get(id(req))
        if d is None:
            d = self.detokenizers[id(req)] = IncrementalDetokenizer(self.tokenizer, req.params)
        return d

    def finish(self, req: Request, reason: FinishReason, out: list[CompletionDelta],
                delta: CompletionDelta | None = None, error: str | None = None) -> None:
        if delta is None:
            delta = CompletionDelta(req.group_id, req.index, [], "")
        if id(req) in self.final_only:
            delta = self._hold(req, delta)
            del self.final_only[id(req)]
        detok = self.detokenizers.pop(id(req), None)
        if detok is not None and not isinstance(req.stop_reason, str):
            delta.text += detok.flush()   # a matched stop string already cut the text
        req.status = RequestStatus.for_finish(reason)
        req.error = error
        delta.finish_reason = int(reason)
        delta.stop_reason = req.stop_reason
        delta.error = error
        self.scheduler.remove(req)
        for sib in req.siblings:   # never forked: they share the leader's fate
            self.finish(sib, reason, out, error=error)
        req.siblings = []
        out.append(delta)
        group = self.groups.get(req.group_id, [])
        if all(r.is_finished for r in group):
            self.groups.pop(req.group_id, None)
