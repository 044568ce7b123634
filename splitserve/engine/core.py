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
        self._batch: list[Request] = []            # the running step's requests
        self.remote_kv = RemoteKV(config.kv, self.block_manager, self.runner.kv_cache, cfg,
                                  config.torch_dtype)
        logger.info("engine: %s %s, %d KV blocks of %d tokens, max_model_len %d", cfg.name,
                    config.dtype, num_blocks, block_size, self.max_model_len)

    # -- requests in ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptTokens, params: SamplingParams,
                    context_only: bool = False, remote: RemotePrefill | None = None,
                    received_time: float | None = None, stream: bool = True,
                    resumed: np.ndarray | None = None) -> None:
        """Validate and queue; raises InvalidRequestError naming the problem. Any other
        failure ends the request with an error delta from the next step().
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
        try:
            self._admit(request_id, prompt, params, context_only, remote, received_time, stream,
                        resumed)
        except Exception:   # a bug admitting one request ends that request, not the engine
            logger.exception("engine: admitting request %s failed", request_id)
            self._discard_group(request_id)
            self.pending.append(CompletionDelta(
                request_id, -1, [], "", finish_reason=int(FinishReason.ERROR),
                error="internal error while admitting the request"))

    def _admit(self, request_id: str, prompt: PromptTokens, params: SamplingParams,
               context_only: bool, remote: RemotePrefill | None, received_time: float | None,
               stream: bool, resumed: np.ndarray | None) -> None:
        eos = () if params.ignore_eos else self.model_config.eos_token_ids
        children = self.groups[request_id] = []
        for i in range(params.n):
            child_params = params
            if params.seed is not None and i:
                child_params = _with_seed(params, _wrap_int64(params.seed + i))
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
        self.scheduler.add(leader)

    def _discard_group(self, request_id: str) -> None:
        """Forget a group that never fully entered the engine, freeing whatever it took."""
        for req in self.groups.pop(request_id, ()):
            self._forget(req)

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
                self._guard(req, self.pending, "aborting", self._finish, req, FinishReason.ABORT,
                            self.pending)

    # -- the step -------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def has_runnable_work(self) -> bool:
        """False when every unfinished request waits on a KV pull: the loop may sleep."""
        s = self.scheduler
        return bool(s.running or s.waiting or self.pending)

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
        self._poll_remote_kv(out)
        sched = self.scheduler.schedule()
        self._batch = [req for req, _ in sched.scheduled] + sched.pulls
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
            self._fail_all([req for req, _ in sched.scheduled], out, "running the model")
            return
        for req, n in sched.scheduled:
            self._guard(req, out, "caching its KV blocks", self._computed, req, n)
        for req, start, logits in result.prompt_logits.values():
            self._guard(req, out, "computing prompt logprobs", self._record_prompt_logprobs,
                        req, start, logits)
        self._sample(result, out)

    def _computed(self, req: Request, n: int) -> None:
        req.num_computed_tokens += n
        self.block_manager.cache_full_blocks(req)

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
            # Find the row(s) at fault: sample each alone. A seeded row whose generator drew
            # in the failed call draws again, so its token for this step may differ.
            logger.exception("engine: sampling a batch of %d failed; sampling each alone",
                             len(requests))
            picks = self._sample_each(logits, requests, out)
        for req, token, logprob in picks:
            self._guard(req, out, "detokenizing", self._append_token, req, token, logprob, out)

    def _sample_each(self, logits: torch.Tensor, requests: list[Request],
                     out: list[CompletionDelta]) -> list[tuple[Request, int, object]]:
        picks = []
        for i, req in enumerate(requests):
            one = self._guard(req, out, "sampling", self.sampler, logits[i:i + 1], [req])
            if one is not None:
                picks.append((req, one.token_ids[0], one.logprobs[0]))
        return picks

    # -- failures -------------------------------------------------------------------------
    def _guard(self, req: Request, out: list[CompletionDelta], doing: str, fn, *args):
        """fn(*args); if it raises, req ends with an error and the result is None."""
        try:
            return fn(*args)
        except Exception:
            logger.exception("engine: request %s failed while %s", req.request_id, doing)
            self._fail(req, out, doing)
            return None

    def _fail(self, req: Request, out: list[CompletionDelta], doing: str) -> None:
        if req.is_finished:
            return
        error = f"internal error while {doing} (see the worker's log)"
        try:
            self._finish(req, FinishReason.ERROR, out, error=error)
        except Exception:   # its state is beyond repair: forget it without its bookkeeping
            logger.exception("engine: ending request %s failed", req.request_id)
            self._drop(req, out, error)

    def _fail_all(self, requests: list[Request], out: list[CompletionDelta],
                  doing: str = "running the engine's step") -> None:
        for req in requests:
            self._fail(req, out, doing)

    def _drop(self, req: Request, out: list[CompletionDelta], error: str) -> None:
        for r in (req, *req.siblings):
            self._forget(r)
            out.append(CompletionDelta(r.group_id, r.index, [], "", error=error,
                                       finish_reason=int(FinishReason.ERROR)))
        req.siblings = []
        if all(r.is_finished for r in self.groups.get(req.group_id, ())):
            self.groups.pop(req.group_id, None)

    def _forget(self, req: Request) -> None:
        """Take req out of every structure and free its blocks, without finishing it."""
        req.status = RequestStatus.FINISHED_ERROR
        self.final_only.pop(id(req), None)
        self.detokenizers.pop(id(req), None)
        try:
            self.scheduler.remove(req)
        except Exception:
            logger.exception("engine: request %s's blocks could not be freed", req.request_id)

    def _fork_siblings(self, leader: Request, out: list[CompletionDelta]) -> list[Request]:
        """n > 1: siblings share the leader's prompt blocks and sample from its logits."""
        siblings, leader.siblings = leader.siblings, []
        return [sib for sib in siblings if self._guard(sib, out, "forking", self._fork, leader, sib)]

    def _fork(self, leader: Request, sib: Request) -> bool:
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
            self._guard(req, out, "receiving its KV", self._kv_arrived, req, result, out)

    def _kv_arrived(self, req: Request, result, out: list[CompletionDelta]) -> None:
        if req.is_finished:            # aborted while its KV was arriving
            self.block_manager.free(req)
            return
        req.kv_transfer_time = result.seconds
        if not result.ok:
            self._finish(req, FinishReason.ERROR, out, error=f"KV transfer from "
                         f"{req.remote.handle.endpoint} failed: {result.error}")
            return
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


def _wrap_int64(seed: int) -> int:
    """Sibling i's seed is seed + i, wrapped into int64 like a C counter: a seed at the top
    of the range must not push its siblings' past what msgpack and torch take."""
    return (seed + 2**63) % 2**64 - 2**63
