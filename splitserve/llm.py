"""Offline API: LLM(model=...).generate(prompts, SamplingParams) and LLM.chat(messages)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.engine.core import EngineCore
from splitserve.errors import InvalidRequestError
from splitserve.protocol.block_hashes import salted_root
from splitserve.protocol.cache_salt import check_cache_salt
from splitserve.protocol.engine import CompletionDelta, EngineRequest, FinishReason, Logprob
from splitserve.protocol.openai_requests import convert_chat_request
from splitserve.protocol.prompts import chat_prompt
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None       # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: PromptTokens
    outputs: list[CompletionOutput]
    prompt_logprobs: list[Logprob | None] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    def add(self, delta: CompletionDelta) -> None:
        out = self.outputs[delta.index]
        out.text += delta.text
        out.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            out.logprobs = (out.logprobs or []) + delta.logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.num_prompt_tokens:
            self.num_cached_tokens = delta.num_cached_tokens
        if delta.finish_reason is not None:
            out.finish_reason = str(FinishReason(delta.finish_reason))
            out.stop_reason, out.error = delta.stop_reason, delta.error


class LLM:
    """The defaults are the config dataclasses' (those of `splitserve serve`)."""

    def __init__(self, model: str | None = EngineConfig.model, *,
                 device: str = EngineConfig.device,
                 load_format: str = EngineConfig.load_format,
                 dtype: str = EngineConfig.dtype,
                 quantization: str | None = EngineConfig.quantization,
                 max_model_len: int | None = EngineConfig.max_model_len,
                 block_size: int = CacheConfig.block_size,
                 num_blocks: int | None = CacheConfig.num_blocks,
                 kv_cache_memory_bytes: int = CacheConfig.memory_bytes,
                 enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
                 max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
                 max_num_seqs: int = SchedulerConfig.max_num_seqs,
                 seed: int | None = EngineConfig.seed,
                 num_threads: int | None = EngineConfig.num_threads,
                 gpu_memory_utilization: float | None = EngineConfig.gpu_memory_utilization,
                 enforce_eager: bool = EngineConfig.enforce_eager,
                 cuda_graph_max_batch: int = EngineConfig.cuda_graph_max_batch):
        config = EngineConfig(
            model=model, device=device, load_format=load_format, dtype=dtype,
            quantization=quantization, max_model_len=max_model_len, num_threads=num_threads,
            seed=seed, gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager, cuda_graph_max_batch=cuda_graph_max_batch,
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                              memory_bytes=kv_cache_memory_bytes,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                      max_num_seqs=max_num_seqs))
        self.engine = EngineCore(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, cache_salt: str | None = None) -> list[RequestOutput]:
        """prompts: a string, a token-id list, a PromptTokens, or a list of those.
        cache_salt: these prompts share prefix-cache blocks only with requests of the same
        salt (protocol/cache_salt.py)."""
        if isinstance(prompts, (str, PromptTokens)) or _is_token_ids(prompts):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError("need one SamplingParams per prompt", "sampling_params")
        root = _root(cache_salt)
        results = [self._add(p, sp, root) for p, sp in zip(prompts, params)]
        return self._run(results)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, add_generation_prompt: bool = True,
             *, chat_template_kwargs: dict | None = None,
             cache_salt: str | None = None) -> list[RequestOutput]:
        """messages: one conversation or a list of them, each rendered into its prompt as
        /v1/chat/completions renders a request of the same fields (protocol/prompts.py)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [chat_prompt(self.tokenizer, convert_chat_request(
            {"messages": m, "add_generation_prompt": add_generation_prompt,
             "chat_template_kwargs": chat_template_kwargs}), self.engine.max_model_len)
            for m in conversations]
        root = _root(cache_salt)
        results = [self._add(t, sampling_params or SamplingParams(), root, text=p)
                   for p, t in prompts]
        return self._run(results)

    def _add(self, prompt, params: SamplingParams, root: bytes,
             text: str | None = None) -> RequestOutput:
        if isinstance(prompt, str):
            text, prompt = prompt, PromptTokens(self.tokenizer.encode(prompt))
        elif not isinstance(prompt, PromptTokens):
            prompt = PromptTokens.from_list(prompt)
        request_id = str(next(self._ids))
        self.engine.add_request(EngineRequest.build(request_id, prompt, params, hash_root=root))
        return RequestOutput(request_id, text, prompt, [CompletionOutput(i) for i in range(params.n)])

    def _run(self, results: list[RequestOutput]) -> list[RequestOutput]:
        by_id = {r.request_id: r for r in results}
        try:
            while any(not r.finished for r in results):
                for delta in self.engine.step():
                    if delta.request_id in by_id:
                        by_id[delta.request_id].add(delta)
        finally:   # an interrupted run leaves no request holding blocks
            for r in results:
                if not r.finished:
                    self.engine.abort_request(r.request_id)
            self.engine.step()
        return results


def _root(cache_salt: str | None) -> bytes:
    check_cache_salt(cache_salt)
    return salted_root(cache_salt)


def _is_token_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) for t in x)
