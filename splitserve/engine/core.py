"""EngineCore: the scheduler, block manager, model runner and sampler behind one step().

step() is pure with respect to I/O: requests go in through add_request/abort_request and
results come out as CompletionDeltas, so tests drive it in-process and the process wrapper
only moves messages.
"""

from __future__ import annotations

import logging
import time

import msgspec
import numpy as np
import torch

from splitserve.config import EngineConfig
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.engine.disagg import RemoteKV
from splitserve.engine.prompt_reads import prompt_value_readers
from splitserve.engine.request import FinishReason, Request, RequestStatus
from splitserve.engine.runner import ModelRunner, StepResult
from splitserve.engine.sampler import Sampler, prompt_logprobs
from splitserve.engine.scheduler import Scheduler
from splitserve.errors import InvalidRequestError
from splitserve.model.llama import build_model
from splitserve.model.loader import ModelSource, load_model_source
from splitserve.protocol.engine import CompletionDelta, RemotePrefill
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens

logger = logging.getLogger(__name__)

class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.source = source or load_model_source(config.model)
        cfg = self.model_config = self.source.config
        self.tokenizer = self.source.tokenizer
        model = build_model(cfg, self.source.weights(), config.torch_dtype, config.quantization,
                            config.pack_weights)
        block_size = config.cache.block_size
        num_blocks = config.cache.num_blocks or max(
            config.cache.memory_bytes // ModelRunner.kv_block_bytes(cfg, block_size, config.torch_dtype), 2)
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings,
                                 cfg.max_position_embeddings, num_blocks * block_size)
        self.block_manager = BlockManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.runner = ModelRunner(model, cfg, num_blocks, block_size, config.torch_dtype)
        self.sampler = Sampler(cfg.vocab_size, seed=config.seed)
        self.groups: dict[str, list[Request]] = {}
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}
        # Sequences whose response is sent whole (stream=False): their deltas are merged here
        # and leave once, when the sequence finishes, not once per step. Keyed like
        # detokenizers; the value is None until the first token.
        self.final_only: dict[int, CompletionDelta | None] = {}
        self.pending: list[CompletionDelta] = []   # deltas produced between steps (aborts)
        self.remote_kv = RemoteKV(config.kv, self.block_manager, self.runner.kv_cache, cfg,
                                  config.torch_dtype)
        logger.info("engine: %s %s, %d KV blocks of %d tokens, max_model_len %d", cfg.name,
                    config.dtype, num_blocks, block_size, self.max_model_len)

    # -- requests in ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptTokens, params: SamplingParams,
                    context_only: bool = False, remote: RemotePrefill | None = None,
                    received_time: float | None = None, stream: bool = True,
                    resumed: np.ndarray | None = None) -> None:
        """Validate and queue; raises InvalidRequestError naming the problem.
        context_only: stop after the first token and lease the KV to a generation worker.
        remote: the prompt's KV is pulled from a context worker instead of computed.
        stream=False: each sequence yields one delta, when it finishes, holding everything it
        generated (its first-token fields and first_token_time included).
        resumed: output tokens another worker already streamed (mid-stream migration): they
        are recomputed with the prompt and the request continues after them."""
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        self._validate(prompt, params)
        if (context_only or remote is not None) and params.n > 1:
            raise InvalidRequestError("n > 1 is not supported for disaggregated requests", "n")
        if remote is not None:
            self.remote_kv.check(remote, len(prompt), self.model_config.vocab_size)
        if prompt.is_placeholder:
            self._check_length_only(params, remote)
        if resumed is not None:
            self._check_resumed(prompt, params, resumed, context_only or remote is not None)
        eos = () if params.ignore_eos else self.model_config.eos_token_ids
        children = []
        for i in range(params.n):
            child_params = params
            if params.seed is not None and i:
                child_params = _with_seed(params, params.seed + i)
            req = Request(f"{request_id}#{i}" if params.n > 1 else request_id, prompt, child_params,
                          eos, self.max_model_len, received_time)
            req.group_id, req.index = request_id, i
            children.append(req)
            if not stream:
                self.final_only[id(req)] = None
        leader, siblings = children[0], children[1:]
        leader.context_only, leader.remote = context_only, remote
        if resumed is not None:
            self._resume(leader, resumed)
        for s in siblings:
            s.status = RequestStatus.WAITING_FOR_FORK
        leader.siblings = siblings
        self.groups[request_id] = children
        self.scheduler.add(leader)

    def _validate(self, prompt: PromptTokens, params: SamplingParams) -> None:
        n = len(prompt)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens; this model's context is {self.max_model_len} tokens "
                f"including at least one generated token", "prompt")
        if not prompt.is_placeholder:
            lo, hi = int(prompt.array.min()), int(prompt.array.max())
            if lo < 0 or hi >= self.model_config.vocab_size:
                bad = lo if lo < 0 else hi
                raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary "
                                          f"[0, {self.model_config.vocab_size})", "prompt")
        params.check_vocab(self.model_config.vocab_size)

    @staticmethod
    def _check_length_only(params: SamplingParams, remote) -> None:
        if remote is None:
            raise InvalidRequestError("a length-only prompt needs its KV from a context worker",
                                      "prompt")
        readers = prompt_value_readers(repetition_penalty=params.repetition_penalty,
                                       prompt_logprobs=params.prompt_logprobs)
        if readers:
            raise InvalidRequestError(f"{', '.join(readers)} read prompt token values, which a "
                                      f"length-only prompt does not have", readers[0])

    def _check_resumed(self, prompt: PromptTokens, params: SamplingParams, resumed: np.ndarray,
                       disaggregated: bool) -> None:
        param = "disaggregated_params.resume_token_ids"
        if disaggregated or params.n > 1 or prompt.is_placeholder:
            raise InvalidRequestError("a resumed request is an aggregated n = 1 request with "
                                      "its prompt's token values", param)
        if len(resumed) == 0 or int(resumed.min()) < 0 or int(resumed.max()) >= self.model_config.vocab_size:
            raise InvalidRequestError("resume_token_ids must be token ids of this vocabulary", param)
        if len(prompt) + len(resumed) >= self.max_model_len:
            raise InvalidRequestError("the prompt and resume_token_ids fill the model's context",
                                      param)
        if params.max_tokens is not None and len(resumed) >= params.max_tokens:
            raise InvalidRequestError("resume_token_ids already reach max_tokens", param)

    def _resume(self, req: Request, resumed: np.ndarray) -> None:
        """The sequence continues after tokens streamed elsewhere: they count as its output
        (max_tokens, penalties, stop strings) and are prefilled with the prompt, as after a
        preemption. Their text was sent already: the detokenizer reads it without emitting,
        so text it held back (a possible stop string) comes out as it would have."""
        req.output_token_ids = resumed.tolist()
        req.num_resumed_tokens = len(req.output_token_ids)
        self._detokenizer(req).step(req.output_token_ids)

    def abort_request(self, request_id: str) -> None:
        for req in self.groups.get(request_id, ()):
            if not req.is_finished:
                self._finish(req, FinishReason.ABORT, self.pending)

    # -- the step -------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def has_runnable_work(self) -> bool:
        """False when every unfinished request waits on a KV pull: the loop may sleep."""
        s = self.scheduler
        return bool(s.running or s.waiting or self.pending)

    def step(self) -> list[CompletionDelta]:
        out, self.pending = self.pending, []
        self._poll_remote_kv(out)
        sched = self.scheduler.schedule()
        for req in sched.pulls:
            self.remote_kv.start_pull(req)
        for req in sched.starved:
            self._finish(req, FinishReason.ERROR, out, error="out of KV cache blocks")
        if not sched:
            return out
        try:
            result = self.runner.execute(sched.scheduled)
        except Exception as exc:   # one bad batch ends its requests, not the engine
            logger.exception("engine: step failed")
            for req, _ in sched.scheduled:
                self._finish(req, FinishReason.ERROR, out, error=f"engine step failed: {exc}")
            return out
        for req, n in sched.scheduled:
            req.num_computed_tokens += n
            self.block_manager.cache_full_blocks(req)
        self._record_prompt_logprobs(result)
        self._sample(result, out)
        return out

    def _record_prompt_logprobs(self, result: StepResult) -> None:
        for req, start, logits in result.prompt_logits.values():
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None]
            if start + 1 < len(req.prompt_logprobs):
                continue   # recomputed after preemption: already recorded
            targets = torch.from_numpy(req.prompt.array[start + 1:start + 1 + logits.shape[0]].astype(np.int64))
            req.prompt_logprobs.extend(prompt_logprobs(logits, targets, req.params.prompt_logprobs))

    def _sample(self, result: StepResult, out: list[CompletionDelta]) -> None:
        if result.logits is None:
            return
        requests, rows = list(result.sample_requests), list(range(len(result.sample_requests)))
        for row, req in enumerate(result.sample_requests):
            for sib in self._fork_siblings(req):
                requests.append(sib)
                rows.append(row)
        logits = result.logits if len(rows) == len(result.logits) else result.logits[rows]
        sampled = self.sampler(logits, requests)
        for req, token, logprob in zip(requests, sampled.token_ids, sampled.logprobs):
            self._append_token(req, token, logprob, out)

    def _fork_siblings(self, leader: Request) -> list[Request]:
        """n > 1: siblings share the leader's prompt blocks and sample from its logits."""
        siblings, leader.siblings = leader.siblings, []
        forked = []
        for sib in siblings:
            if self.block_manager.num_free_blocks < 1:
                sib.status = RequestStatus.WAITING    # no room to fork: recompute (prefix cache helps)
                self.scheduler.add(sib)
                continue
            copy = self.block_manager.fork(leader, sib)
            if copy is not None:
                self.runner.copy_block(*copy)
            sib.num_computed_tokens = leader.num_computed_tokens
            sib.prompt_logprobs = leader.prompt_logprobs
            sib.status = RequestStatus.RUNNING
            self.scheduler.running.append(sib)
            forked.append(sib)
        return forked

    def _append_token(self, req: Request, token: int, logprob, out: list[CompletionDelta]) -> None:
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
            if id(req) in self.final_only:
                delta.first_token_time = time.time()   # its TTFT: no delta leaves now
        reason = self._check_stop(req, token, delta)
        if reason is None and req.context_only:
            delta.kv_handle = self.remote_kv.lease(req)
            reason = FinishReason.HANDOFF
        if reason is not None:
            self._finish(req, reason, out, delta)
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
        text, stop = self._detokenizer(req).step([token])
        delta.text = text
        if stop is not None:
            req.stop_reason = stop
            return FinishReason.STOP
        if req.num_output_tokens >= req.max_tokens:
            return FinishReason.LENGTH
        return None

    def _poll_remote_kv(self, out: list[CompletionDelta]) -> None:
        self.remote_kv.release_ended_leases()
        for req, result in self.remote_kv.finished_pulls():
            if req.is_finished:            # aborted while its KV was arriving
                self.block_manager.free(req)
                continue
            req.kv_transfer_time = result.seconds
            if not result.ok:
                self._finish(req, FinishReason.ERROR, out, error=f"KV transfer from "
                             f"{req.remote.handle.endpoint} failed: {result.error}")
                continue
            remote = req.remote
            self.scheduler.kv_arrived(req)
            self.block_manager.cache_full_blocks(req)
            lps = remote.first_gen_logprobs or [None] * len(remote.first_gen_tokens)
            for token, lp in zip(remote.first_gen_tokens, lps):
                if not req.is_finished:
                    self._append_token(req, token, lp, out)

    def _detokenizer(self, req: Request) -> IncrementalDetokenizer:
        d = self.detokenizers.get(id(req))
        if d is None:
            d = self.detokenizers[id(req)] = IncrementalDetokenizer(self.tokenizer, req.params)
        return d

    def _finish(self, req: Request, reason: FinishReason, out: list[CompletionDelta],
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
            self._finish(sib, reason, out, error=error)
        req.siblings = []
        out.append(delta)
        group = self.groups.get(req.group_id, [])
        if all(r.is_finished for r in group):
            self.groups.pop(req.group_id, None)

    # -- introspection --------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return msgspec.structs.replace(params, seed=seed)
