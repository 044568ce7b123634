"""EngineCore: the scheduler, block manager, model runner and sampler behind one step().

step() is pure with respect to I/O: requests go in through add_request/abort_request and
results come out as CompletionDeltas, so tests drive it in-process and the process wrapper
only moves messages.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from splitserve.config import EngineConfig
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.admission import (check_length_only, check_relayed_prompt,
                                         check_resumed, sibling_params)
from splitserve.engine.failures import FailureHandling
from splitserve.engine.grammar import GrammarFailed, GrammarRoom, advance, start_matcher
from splitserve.engine.output import OutputBuilder
from splitserve.engine.disagg import RemoteKV, can_move
from splitserve.engine.prompt_reads import reads_prompt
from splitserve.engine.request import FinishReason, Request
from splitserve.engine.runner import ModelRunner, StepResult
from splitserve.engine.sampler import Sampler, prompt_logprobs
from splitserve.engine.scheduler import Scheduler
from splitserve.errors import InvalidRequestError
from splitserve.grammar_compile import GrammarCompiler
from splitserve.model.llama import build_model
from splitserve.model.loader import ModelSource, load_model_source
from splitserve.protocol.engine import CompletionDelta, EngineRequest
from splitserve.protocol.prompts import check_prompt

logger = logging.getLogger(__name__)

class EngineCore(FailureHandling):
    def __init__(self, config: EngineConfig, source: ModelSource | None = None):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.source = source or load_model_source(config.model, config.load_format)
        cfg = self.model_config = self.source.config
        self.tokenizer = self.source.tokenizer
        platform = config.platform
        platform.check_config(config.quantization)
        model = build_model(cfg, self.source.weights(), config.torch_dtype, config.quantization,
                            config.pack_weights, platform)
        block_size = config.cache.block_size
        kv_bytes = platform.kv_cache_bytes(config.cache.memory_bytes, config.gpu_memory_utilization)
        num_blocks = config.cache.num_blocks or max(
            kv_bytes // ModelRunner.kv_block_bytes(cfg, block_size, config.torch_dtype), 2)
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings,
                                 cfg.max_position_embeddings, num_blocks * block_size)
        self.block_manager = BlockManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.runner = ModelRunner(model, cfg, num_blocks, block_size, config.torch_dtype, platform,
                                  config.graph_max_batch, -(-self.max_model_len // block_size))
        self.sampler = Sampler(cfg.vocab_size, seed=config.seed, device=platform.device)
        self.pending: list[CompletionDelta] = []   # deltas produced between steps (aborts)
        self.draining: set[int] = set()            # front-ends whose streams are handed off
        self._batch: list[Request] = []            # the running step's requests
        self.remote_kv = RemoteKV(config.kv, self.block_manager, self.runner.kv_cache, cfg,
                                  config.torch_dtype, platform)
        self.output = OutputBuilder(self.tokenizer)
        self.grammars = GrammarRoom(GrammarCompiler(self.tokenizer.to_json(), cfg.vocab_size,
                                                    self.tokenizer.eos_token_ids))
        logger.info("engine: %s %s on %s, %d KV blocks of %d tokens, max_model_len %d%s", cfg.name,
                    str(config.torch_dtype).removeprefix("torch."), platform.name, num_blocks,
                    block_size, self.max_model_len,
                    self.runner.graphs.describe() if self.runner.graphs else "")

    # -- requests in ----------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Validate and queue; raises InvalidRequestError naming the problem. Any other
        failure ends the request with an error delta from the next step().
        request.prompt: its prompt_len tokens (a placeholder: only their number);
        request.resumed: the num_resumed output tokens another worker already streamed
        (mid-stream migration): they are recomputed with the prompt and the request continues
        after them. stream=False: each sequence yields one delta, when it finishes, holding
        everything it generated (its first-token fields and first_token_time included)."""
        rid, params, remote = request.request_id, request.params, request.remote
        prompt, resumed = request.prompt, request.resumed
        if rid in self.scheduler.groups or rid in self.grammars:
            raise InvalidRequestError(f"request id {rid!r} is already in use", "request_id")
        check_prompt(prompt, params, self.model_config.vocab_size, self.max_model_len)
        if request.disaggregated and params.n > 1:
            raise InvalidRequestError("n > 1 is not supported for disaggregated requests", "n")
        hashes = None   # of a relayed prompt: checked against the KV handle's digest
        if remote is not None:
            self.remote_kv.check(remote, len(prompt), self.model_config.vocab_size,
                                 request.num_resumed)
            if not prompt.is_placeholder:
                hashes = check_relayed_prompt(prompt.array, remote.handle,
                                              self.block_manager.block_size, request.hash_root)
            else:   # the context worker's: trusted, as the peer that sent them is
                hashes = self.remote_kv.peer_hashes(remote.handle, len(prompt))
        if prompt.is_placeholder:
            check_length_only(params, remote)
        if resumed is not None:
            check_resumed(prompt, params, resumed.array, request.kind,
                          self.model_config.vocab_size, self.max_model_len)
        if params.grammar is not None and self.grammars.cached(request) is None:
            self.grammars.submit(request, hashes)   # admitted by a step once compiled
            return
        self._admit_guarded(request, hashes)

    def _admit_guarded(self, request: EngineRequest, hashes: list[bytes] | None) -> None:
        rid = request.request_id
        try:
            self._admit(request, hashes)
        except Exception:   # a bug admitting one request ends that request, not the engine
            logger.exception("engine: admitting request %s failed", rid)
            self._discard_group(rid)
            self._reject(rid, FinishReason.ERROR, "internal error while admitting the request")

    def _reject(self, rid: str, reason: FinishReason, error: str | None) -> None:
        self.pending.append(CompletionDelta(rid, -1, [], "", finish_reason=int(reason),
                                            error=error))

    def _admit_compiled(self) -> None:
        """Requests whose grammar finished compiling enter the scheduler (or fail)."""
        for request, hashes, _, error in self.grammars.ready():
            if error is None:
                self._admit_guarded(request, hashes)
            else:
                self._reject(request.request_id, FinishReason.ERROR, error)

    def _admit(self, request: EngineRequest, hashes: list[bytes] | None) -> None:
        """The request's n sequences: the leader (index 0) holds the others until it forks
        them after its prefill (queues.py)."""
        rid, params, n = request.request_id, request.params, request.params.n
        prompt, resumed, received_time = request.prompt, request.resumed, request.received
        eos = () if params.ignore_eos else self.model_config.eos_token_ids
        root = request.hash_root
        template = None if params.grammar is None else self.grammars.cached(request)
        siblings = [Request(f"{rid}#{i}", prompt, sibling_params(params, i), eos,
                            self.max_model_len, received_time, group_id=rid, index=i,
                            hash_root=root, grammar=_matcher(template, []))
                    for i in range(1, n)]
        resumed = None if resumed is None else resumed.tolist()
        # hashes: verified, so what its pulled KV is filed under in the prefix cache.
        leader = Request(f"{rid}#0" if n > 1 else rid, prompt, params, eos, self.max_model_len,
                         received_time, group_id=rid, kind=request.kind, remote=request.remote,
                         siblings=siblings, block_hashes=hashes, hash_root=root,
                         resumed=resumed,
                         grammar=_matcher(template, resumed or []))
        leader.pull_prompt = prompt.is_placeholder and reads_prompt(params, request.prompt_back)
        leader.prompt_back = leader.pull_prompt and request.prompt_back
        leader.movable, leader.peer = request.movable and n == 1, request.peer
        self.scheduler.add(leader)
        # Final-only output, except for sequences with generation logprobs: held, their
        # deltas grow to the whole response's logprobs (2^20 entries at the bound), which the
        # front-end decodes as one message on its event loop (~1 s); per step, k + 1 each.
        if not request.stream and params.logprobs is None:
            for req in (leader, *siblings):
                self.output.send_whole(req)
        if resumed is not None:   # its text was sent already: the detokenizer reads it silently
            self.output.detokenizer(leader).step(leader.output_token_ids)

    def abort_request(self, request_id: str) -> None:
        if self.grammars.abort(request_id):   # still compiling: it never ran
            self._reject(request_id, FinishReason.ABORT, None)
        for req in self.scheduler.groups.get(request_id, ()):
            if not req.is_finished:
                self._guard(req, self.pending, "aborting", self._finish, req, FinishReason.ABORT,
                            self.pending)

    def drain(self, peer: int = 0) -> None:
        """Front-end `peer` is stopping: from the next step on, each of its movable streams
        that is decoding ends at the step boundary with a HANDOFF delta carrying its KV lease
        (remote_kv.move), for the orchestrator to continue on another worker; the rest run
        to their end. undrain(peer) ends it (a new front-end took the peer's place)."""
        self.draining.add(peer)

    def undrain(self, peer: int) -> None:
        self.draining.discard(peer)

    def _hand_off_streams(self, out: list[CompletionDelta]) -> None:
        moving = [r for r in self.scheduler.running if r.peer in self.draining and can_move(r)]
        for req in moving:
            self._guard(req, out, "handing it off", self._move, req, out)

    def _move(self, req: Request, out: list[CompletionDelta]) -> None:
        delta = CompletionDelta(req.group_id, req.index, [], "")
        delta.kv_handle = self.remote_kv.move(req)
        self._finish(req, FinishReason.HANDOFF, out, delta)

    def _finish(self, req: Request, reason: FinishReason, out: list[CompletionDelta],
                delta: CompletionDelta | None = None, error: str | None = None) -> None:
        """req ends (and its never-forked siblings with it): their final deltas are built
        first, so a failure building one changes no state; then the scheduler ends them."""
        deltas = [self.output.final_delta(sib, reason, error=error) for sib in req.siblings]
        deltas.append(self.output.final_delta(req, reason, delta, error))
        try:
            self.scheduler.finish(req, reason, error)
        finally:   # ended even if freeing its blocks failed: its client hears so
            out.extend(deltas)

    @property
    def groups(self) -> dict[str, list[Request]]:
        """Every unfinished request's sequences, by request id (the scheduler's)."""
        return self.scheduler.groups

    # -- the step -------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.groups) or bool(len(self.grammars))

    def has_runnable_work(self) -> bool:
        """False when every unfinished request waits on a KV pull: the loop may sleep."""
        s = self.scheduler
        return bool(s.running or s.waiting or self.pending or len(self.grammars))

    def step(self) -> list[CompletionDelta]:
        """Never raises: a failure ends the request(s) it concerns with an error delta."""
        out, self.pending = self.pending, []
        self._batch = []
        try:
            self._step(out)
        except Exception:   # last resort: a failure no one request could be blamed for
            logger.exception("engine: step failed")
            self._fail_all(self._batch or [r for g in self.groups.values() for r in g], out)
        return out

    def _step(self, out: list[CompletionDelta]) -> None:
        self._admit_compiled()
        self._poll_remote_kv(out)
        if self.draining:
            self._hand_off_streams(out)
        sched = self.scheduler.schedule()
        self._batch = [*sched.scheduled, *sched.pulls]
        for req in sched.pulls:
            self._guard(req, out, "starting its KV transfer", self.remote_kv.start_pull, req)
        for req in sched.starved:
            self._finish(req, FinishReason.ERROR, out, error="out of KV cache blocks")
        for req in sched.failed:
            self._fail(req, out, "scheduling")
        if not sched:
            return
        try:
            result = self.runner.execute(sched.scheduled)
        except Exception:   # one bad batch ends its requests, not the engine
            logger.exception("engine: the model's forward pass failed")
            self._fail_all(list(sched.scheduled), out, "running the model")
            return
        for req, n in sched.scheduled.items():
            self._guard(req, out, "caching its KV blocks", self.scheduler.computed, req, n)
        for req, start, logits in result.prompt_logits.values():
            self._guard(req, out, "computing prompt logprobs", self._record_prompt_logprobs,
                        req, start, logits)
        self._sample(result, out)

    def _record_prompt_logprobs(self, req: Request, start: int, logits: torch.Tensor) -> None:
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]
        if start + 1 < len(req.prompt_logprobs):
            return   # recomputed after preemption: already recorded
        targets = torch.from_numpy(req.prompt.array[start + 1:start + 1 + logits.shape[0]].astype(np.int64))
        req.prompt_logprobs.extend(prompt_logprobs(logits, targets, req.params.prompt_logprobs))

    def _sample(self, result: StepResult, out: list[CompletionDelta]) -> None:
        if result.logits is None:
            return
        requests, rows = [], []
        for row, req in enumerate(result.sample_requests):
            if req.is_finished:        # failed earlier in this step
                continue
            requests.append(req)
            rows.append(row)
            for sib in self._fork_siblings(req, out):
                requests.append(sib)
                rows.append(row)
        if not requests:
            return
        logits = result.logits if len(rows) == len(result.logits) else result.logits[rows]
        try:
            sampled = self.sampler(logits, requests)
            picks = zip(requests, sampled.token_ids, sampled.logprobs)
        except Exception:
            # Find the row(s) at fault: sample each alone. A seeded row draws the same token
            # alone as in the batch (engine/seeded.py); an unseeded one draws afresh.
            logger.exception("engine: sampling a batch of %d failed; sampling each alone",
                             len(requests))
            picks = self._sample_each(logits, requests, out)
        for req, token, logprob in picks:
            self._guard(req, out, "detokenizing", self._on_token, req, token, logprob, out)

    def _on_token(self, req: Request, token: int, logprob, out: list[CompletionDelta]) -> None:
        """The output builder makes the token's delta; the scheduler records the token and
        says whether req ends with it (a context_only request hands its KV off here)."""
        delta, stop_string = self.output.token_delta(req, token, logprob)
        try:
            ended = req.grammar is not None and advance(req.grammar, token)
        except GrammarFailed as exc:   # this request's grammar, not the engine, broke down
            self._finish(req, FinishReason.ERROR, out, error=str(exc))
            return
        reason = self.scheduler.append_token(req, token, stop_string, ended)
        if reason is None:
            self.output.emit(req, delta, out)
            return
        if reason == FinishReason.HANDOFF:
            delta.kv_handle = self.remote_kv.lease(req)
        self._finish(req, reason, out, delta)

    def _fork_siblings(self, leader: Request, out: list[CompletionDelta]) -> list[Request]:
        """n > 1: the siblings forked from the leader after its prefill, each guarded alone."""
        return [sib for sib in self.scheduler.release_siblings(leader)
                if self._guard(sib, out, "forking", self.scheduler.fork, leader, sib,
                               self.runner.copy_block)]

    def _sample_each(self, logits: torch.Tensor, requests: list[Request],
                     out: list[CompletionDelta]) -> list[tuple[Request, int, object]]:
        picks = []
        for i, req in enumerate(requests):
            one = self._guard(req, out, "sampling", self.sampler, logits[i:i + 1], [req])
            if one is not None:
                picks.append((req, one.token_ids[0], one.logprobs[0]))
        return picks

    def _poll_remote_kv(self, out: list[CompletionDelta]) -> None:
        self.remote_kv.release_ended_leases()
        for req, result in self.remote_kv.finished_pulls():
            self._guard(req, out, "receiving its KV", self._kv_arrived, req, result, out)

    def _kv_arrived(self, req: Request, result, out: list[CompletionDelta]) -> None:
        if not self.scheduler.pull_ended(req):   # aborted while its KV was arriving
            return
        req.kv_transfer_time = result.seconds
        if not result.ok:
            self._finish(req, FinishReason.ERROR, out, error=f"KV transfer from the context "
                         f"worker failed: {result.error}")
            return
        remote = req.remote
        self.scheduler.kv_arrived(req)
        lps = remote.first_gen_logprobs or [None] * len(remote.first_gen_tokens)
        for token, lp in zip(remote.first_gen_tokens, lps):
            if not req.is_finished:
                self._on_token(req, token, lp, out)

    # -- introspection --------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_prefill_tokens(self) -> int:
        return self.scheduler.num_prefill_tokens


def _matcher(template, output_tokens: list[int]):
    """A sequence's own grammar matcher (None without a grammar)."""
    return None if template is None else start_matcher(template, output_tokens)
