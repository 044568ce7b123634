"""The scheduler's queues, and every change of a request's state between them.

Scheduler (scheduler.py) extends RequestQueues with the choice of each step's batch; the
two together are the one owner of a request's state. The engine core, the output builder
(which only builds deltas) and the failure handling call these methods; none of them sets
a status, touches a queue, or forks or frees a sequence itself.

Invariants, true between any two calls:
- A request's status names where it is: WAITING or PREEMPTED: in `waiting`; RUNNING: in
  `running`; WAITING_FOR_REMOTE_KV: in `transferring`; WAITING_FOR_FORK: in no queue, held
  in its leader's `siblings` until release_siblings() hands it over to be forked (fork()
  queues it; if forking fails, the caller finishes it); finished: in no queue, no longer
  in a leader's `siblings`.
- A finished request holds no block, except while a KV pull still writes them (`pulling`):
  they are freed when the pull ends (pull_ended()).
- `groups` holds every request id the engine has not finished with: its sequences, the
  leader (index 0) first. A group leaves when the last of them finishes.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.request import FinishReason, Request, RequestStatus

logger = logging.getLogger(__name__)


class RequestQueues:
    def __init__(self, block_manager: BlockManager):
        self.bm = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.transferring: list[Request] = []   # WAITING_FOR_REMOTE_KV
        self.groups: dict[str, list[Request]] = {}

    # -- entering -------------------------------------------------------------------------
    def add(self, leader: Request) -> None:
        """A new request: its leader waits to be scheduled; its n - 1 siblings wait in it
        (WAITING_FOR_FORK) until its prompt is computed."""
        self.groups[leader.group_id] = [leader, *leader.siblings]
        self.waiting.append(leader)

    def release_siblings(self, leader: Request) -> list[Request]:
        """n > 1, the leader's prompt computed: its siblings, each to be forked now (fork());
        the leader holds them no longer."""
        siblings, leader.siblings = leader.siblings, []
        return siblings

    def fork(self, leader: Request, sib: Request, copy_block: Callable[[int, int], None]) -> bool:
        """sib shares the leader's full blocks (a partial last block is copied: copy_block(src,
        dst) copies its KV) and prompt logprobs, and runs, sampling from the leader's logits
        this step. With no free block it waits to be recomputed instead (the prefix cache
        gives most of it back): False."""
        if self.bm.num_free_blocks < 1:
            sib.status = RequestStatus.WAITING
            self.waiting.append(sib)
            return False
        copy = self.bm.fork(leader, sib)
        if copy is not None:
            copy_block(*copy)
        sib.num_computed_tokens = leader.num_computed_tokens
        sib.prompt_logprobs = leader.prompt_logprobs
        sib.status = RequestStatus.RUNNING
        self.running.append(sib)
        return True

    # -- a step's results -----------------------------------------------------------------
    def computed(self, req: Request, n: int) -> None:
        """The model wrote the KV of req's n scheduled tokens: its full blocks are published
        in the prefix cache."""
        req.num_computed_tokens += n
        self.bm.cache_full_blocks(req)

    def append_token(self, req: Request, token: int, stop_string: str | None = None,
                     grammar_ended: bool = False) -> FinishReason | None:
        """req sampled `token` (stop_string: the stop string the detokenizer matched with
        it; grammar_ended: its grammar is complete with it). Why req ends with it, if it
        does: EOS, a stop token id, a stop string, its grammar's end, max_tokens, and a
        context_only request after its first token (HANDOFF), in that order. The caller builds the final delta, then calls finish()."""
        req.output_token_ids.append(token)
        if req.is_stop_token(token):
            if token not in req.eos_token_ids:
                req.stop_reason = token
            return FinishReason.STOP
        if stop_string is not None:
            req.stop_reason = stop_string
            return FinishReason.STOP
        if grammar_ended:
            return FinishReason.STOP
        if req.num_output_tokens >= req.max_tokens:
            return FinishReason.LENGTH
        return FinishReason.HANDOFF if req.context_only else None

    def kv_arrived(self, req: Request) -> None:
        """The pulled KV is in req's blocks: it decodes from here like any running request,
        and its full prompt blocks are filed in the prefix cache under the hashes admission
        checked against the KV handle (a length-only prompt's: the context worker's)."""
        self.transferring.remove(req)
        req.remote = None
        req.num_computed_tokens = req.num_remote_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        assert (req.prompt.is_placeholder or
                len(req.block_hashes) >= req.num_prompt_tokens // self.bm.block_size)
        self.bm.cache_full_blocks(req)

    def pull_ended(self, req: Request) -> bool:
        """req's KV pull ended (it no longer writes req's blocks). False if req finished
        meanwhile (aborted): the blocks the pull held are freed now."""
        if req.is_finished:
            self.bm.free(req)
            return False
        return True

    # -- leaving --------------------------------------------------------------------------
    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        """req ends, its status saying why, and so do its never-forked siblings (they share
        its fate). Each leaves its queue and frees its blocks (a context_only request's were
        leased already)."""
        ended, req.siblings = [req, *req.siblings], []
        for r in ended:
            r.status = RequestStatus.for_finish(reason)
            r.error = error
        self._leave_group(req.group_id)
        for r in ended:
            self._remove(r)

    def drop(self, req: Request) -> list[Request]:
        """The last resort for a request whose own ending failed (its state is beyond
        repair): it and its never-forked siblings end with an error and leave everything,
        their blocks freed where that still works. Returns them."""
        dropped, req.siblings = [req, *req.siblings], []
        for r in dropped:
            r.status = RequestStatus.FINISHED_ERROR
        self._leave_group(req.group_id)
        for r in dropped:
            self._remove_quietly(r)
        return dropped

    def discard_group(self, request_id: str) -> list[Request]:
        """A request whose admission failed halfway: every sequence it has so far leaves,
        ended with an error. Returns them."""
        group = self.groups.pop(request_id, [])
        for r in group:
            r.status = RequestStatus.FINISHED_ERROR
            r.siblings = []
            self._remove_quietly(r)
        return group

    def _leave_group(self, group_id: str) -> None:
        if all(r.is_finished for r in self.groups.get(group_id, ())):
            self.groups.pop(group_id, None)

    def _remove(self, req: Request) -> None:
        """Out of whichever queue holds it; its blocks freed unless a pull still writes
        them (pull_ended() frees them)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.transferring:
            self.transferring.remove(req)
        if not req.pulling:
            self.bm.free(req)

    def _remove_quietly(self, req: Request) -> None:
        try:
            self._remove(req)
        except Exception:
            logger.exception("engine: request %s's blocks could not be freed", req.request_id)

    # -- reading --------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens this engine must still compute before its requests decode: the rest of
        every waiting and running prompt (a preempted request's output too), but not a
        pulled prompt's, whose KV comes from a context worker."""
        waiting = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting
                      if r.remote is None)
        return waiting + sum(left for r in self.running
                             if (left := r.num_tokens - r.num_computed_tokens) > 1)
