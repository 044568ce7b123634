"""Token-budget scheduler: continuous batching with chunked prefill, no separate phases.

Each step hands out at most max_num_batched_tokens tokens. Running requests go first (a
decode needs one token; an unfinished prefill takes the next chunk), then waiting requests
in arrival order. While some request decodes, the step's prefill chunks together take at
most max_prefill_tokens_while_decoding of them (when set): a step's time is every stream's
gap between two tokens, so a long prompt is computed in smaller pieces beside them. When blocks run out, the most recently admitted running request is
preempted: its blocks are freed and it is recomputed later (prefix caching usually gives
most of them back).

The scheduler is the one owner of a request's state (queues.py: its status, its
queue, its tokens and blocks, forks and endings); the engine core, the output builder and
the failure handling ask it to change what they need changed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from splitserve.config import SchedulerConfig
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.request import NO_BLOCKS, Request, RequestStatus
from splitserve.engine.queues import RequestQueues

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    # request -> its new tokens this step, in the order the runner batches them: decodes
    # (one token each) first, then prefill chunks.
    scheduled: dict[Request, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    pulls: list[Request] = field(default_factory=list)   # blocks allocated: start their KV pull
    starved: list[Request] = field(default_factory=list)  # no block, nobody to preempt: fail them
    failed: list[Request] = field(default_factory=list)   # scheduling them raised: fail them

    @property
    def num_tokens(self) -> int:
        return sum(self.scheduled.values())

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass
class _Budget:
    """One step's tokens left: `total` for every row, `prefill` for prefill chunks alone.
    A request needing one token (a decode, or a prompt's last) takes from total only."""
    total: int
    prefill: int

    def grant(self, needed: int) -> int:
        """Tokens a request needing `needed` more gets (0: none left for it)."""
        return min(needed, self.total, self.prefill) if needed > 1 else min(needed, self.total)

    def spend(self, n: int, needed: int) -> None:
        """n tokens granted to a request needing `needed` were scheduled."""
        self.total -= n
        if needed > 1:
            self.prefill -= n


class Scheduler(RequestQueues):
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        super().__init__(block_manager)
        self.config = config

    def schedule(self) -> SchedulerOutput:
        """This step's batch. Moves waiting requests into running (or, generation_only,
        transferring: their KV pull starts) and preempts running ones when blocks run out;
        nothing else changes until the engine reports the step (computed(), append_token())."""
        out = SchedulerOutput()
        budget = _Budget(self.config.max_num_batched_tokens,
                         self.config.prefill_budget_while_decoding if self._decoding()
                         else self.config.max_num_batched_tokens)
        self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        # stable: single-query rows first
        out.scheduled = dict(sorted(out.scheduled.items(), key=lambda item: item[1] > 1))
        return out

    def _decoding(self) -> bool:
        """Whether a running request needs just its next token this step."""
        return any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)

    def _schedule_running(self, out: SchedulerOutput, budget: _Budget) -> None:
        i, stuck = 0, []
        while i < len(self.running) and budget.total > 0:
            req = self.running[i]
            needed = req.num_tokens - req.num_computed_tokens
            n = budget.grant(needed)
            if n == 0:     # a prefill chunk, and the step's prefill tokens are spent
                i += 1
                continue
            while not self._allocate(req, n, out):
                victim = self._victim(i)
                if victim is None:     # only length-only requests after it: wait a step
                    stuck.append(req)
                    break
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return
            else:
                if req in out.failed:
                    self.running.pop(i)
                    continue
                out.scheduled[req] = n
                budget.spend(n, needed)
            i += 1
        if stuck and not out.scheduled:
            out.starved = stuck[:1]    # nothing can move: end one so the rest can

    def _allocate(self, req: Request, n: int, out: SchedulerOutput, cached=NO_BLOCKS) -> bool:
        """bm.allocate; True (and req in out.failed) if it raised: one request's broken
        state must not stop the others being scheduled."""
        try:
            return self.bm.allocate(req, n, cached)
        except Exception:
            logger.exception("engine: allocating blocks for %s failed", req.request_id)
            out.failed.append(req)
            return True

    def _victim(self, i: int) -> Request | None:
        """The most recently admitted running request at or after position i that can be
        recomputed. A length-only prompt (KV pulled from a context worker, values never
        relayed) cannot be: see prompt_reads.py."""
        for victim in reversed(self.running[i:]):
            if not victim.prompt.is_placeholder:
                return victim
        return None

    def _schedule_waiting(self, out: SchedulerOutput, budget: _Budget) -> None:
        while self.waiting and self._num_admitted < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.remote is not None:
                # The prompt's KV comes from a context worker: blocks now, no compute budget,
                # so a step whose budget the running decodes used up still starts pulls.
                # Blocks the prefix cache holds are taken as they are and not pulled.
                cached = self._pulled_prefix(req, out)
                reused = len(cached) * self.bm.block_size
                if not (req in out.failed or
                        self._allocate(req, req.num_remote_tokens - reused, out, cached)):
                    break
                self.waiting.popleft()
                if req in out.failed:
                    continue
                req.num_cached_tokens = reused
                req.status = RequestStatus.WAITING_FOR_REMOTE_KV
                req.first_scheduled_time = time.monotonic()
                self.transferring.append(req)
                out.pulls.append(req)
                continue
            if budget.total <= 0 or budget.prefill <= 0:
                break
            cached = NO_BLOCKS
            if req.num_computed_tokens == 0 and req.params.prompt_logprobs is None:
                cached = self._cached_prefix(req, out)   # cached tokens would have no logprobs
            computed = req.num_computed_tokens + len(cached) * self.bm.block_size
            needed = req.num_tokens - computed
            n = budget.grant(needed)
            if not (req in out.failed or self._allocate(req, n, out, cached)):
                break
            self.waiting.popleft()
            if req in out.failed:
                continue
            if req.num_output_tokens == 0:
                req.num_cached_tokens = len(cached) * self.bm.block_size
            req.num_computed_tokens = computed
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.scheduled[req] = n
            budget.spend(n, needed)

    def _cached_prefix(self, req: Request, out: SchedulerOutput, find=None):
        try:
            return (find or self.bm.find_cached_prefix)(req)
        except Exception:
            logger.exception("engine: the prefix cache lookup for %s failed", req.request_id)
            out.failed.append(req)
            return NO_BLOCKS

    def _pulled_prefix(self, req: Request, out: SchedulerOutput):
        return self._cached_prefix(req, out, self.bm.find_pulled_prefix)

    @property
    def _num_admitted(self) -> int:
        return len(self.running) + len(self.transferring)

    def _preempt(self, req: Request) -> None:
        """req (already out of running) gives its blocks back and waits, first in line, to
        be recomputed."""
        self.bm.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
