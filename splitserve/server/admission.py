"""From a decoded OpenAI body to what the engine is asked: the prompts' checks that must
answer 400 before a response starts (a stream's head leaves before the engine sees the
request), the disaggregated fields, and the EngineRequest of each prompt, built once."""

from __future__ import annotations

from splitserve.errors import InvalidRequestError
from splitserve.protocol.disagg import REQUEST_KIND
from splitserve.protocol.engine import EngineReady, EngineRequest, RemotePrefill, RequestKind
from splitserve.protocol.logprob_bound import MAX_LOGPROB_ENTRIES, check_generation_logprobs
from splitserve.protocol.prompts import check_prompt
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens

def request_kind(req) -> RequestKind:
    dp = req.disaggregated_params
    return REQUEST_KIND[None if dp is None else dp.request_type]


def engine_requests(req, rid: str, prompts: list[PromptTokens], params: SamplingParams,
                    ready: EngineReady, remote: RemotePrefill | None = None,
                    hash_root: bytes = b"") -> list[EngineRequest]:
    """One EngineRequest per prompt, holding it (and the resumed output, if any), once
    every check that names a client's parameter passed. Their ids: rid, rid-1, rid-2, ...
    (the response's id is the first one's). hash_root: the salted root every prompt's block
    hashes start from."""
    check_prompts(prompts, params, ready)
    check_logprobs(req, prompts, params, ready.max_model_len)
    kind = request_kind(req)
    if kind != RequestKind.AGGREGATED and len(prompts) > 1:
        raise InvalidRequestError("a disaggregated request takes one prompt", "prompt")
    if kind == RequestKind.CONTEXT_ONLY and req.stream:
        raise InvalidRequestError("a context_only request cannot stream", "stream")
    resumed = resumed_output(req, prompts, params)
    dp = req.disaggregated_params
    # echo of a length-only prompt: its ids come back from the engine (with its KV)
    back = prompts[0].is_placeholder and bool(getattr(req, "echo", False))
    movable = bool(req.stream) and bool(dp and dp.stream_token_ids) and len(prompts) == 1
    return [EngineRequest.build(f"{rid}-{i}" if i else rid, p, params,
                                kind=kind, remote=remote, stream=bool(req.stream),
                                resumed=resumed, prompt_back=back, hash_root=hash_root,
                                movable=movable)
            for i, p in enumerate(prompts)]


def check_prompts(prompts: list[PromptTokens], params: SamplingParams, ready: EngineReady) -> None:
    """What the engine would reject (the same checks), answered here with a 400 before a
    stream's head leaves; and, unlike the engine, which clamps it, a max_tokens the context
    cannot hold."""
    for p in prompts:
        check_prompt(p, params, ready.vocab_size, ready.max_model_len)
        want = len(p) + (params.max_tokens or 1)
        if want > ready.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {ready.max_model_len} tokens; the "
                f"request asks for {want} ({len(p)} in the prompt, {params.max_tokens or 1} "
                f"to generate)", "max_tokens")


def check_logprobs(req, prompts: list[PromptTokens], params: SamplingParams,
                   max_model_len: int) -> None:
    """Logprobs multiply: prompt and generated tokens, times n, times k + 1, all in one
    response (protocol/logprob_bound.py). A length unset generates what the context leaves."""
    prompt_entries = check_prompt_logprobs(req, prompts, params)
    lengths = [params.max_tokens or max_model_len - len(p) for p in prompts]
    check_generation_logprobs(req, params.n, params.logprobs, lengths, prompt_entries)


def logprob_entries(prompts: list[PromptTokens], params: SamplingParams, generated: int) -> int:
    """The entries of a response whose choices generated `generated` tokens in all."""
    gen = 0 if params.logprobs is None else generated * (params.logprobs + 1)
    return prompt_logprob_entries(prompts, params) + gen


def prompt_logprob_entries(prompts: list[PromptTokens], params: SamplingParams) -> int:
    """Every choice (n of each prompt) carries its prompt's: each position's token and k
    alternatives."""
    k = params.prompt_logprobs
    return 0 if k is None else sum(len(p) for p in prompts) * params.n * (k + 1)


def check_prompt_logprobs(req, prompts: list[PromptTokens], params: SamplingParams) -> int:
    """Prompt logprobs (asked for, or echo with logprobs): their entries, within the bound."""
    entries = prompt_logprob_entries(prompts, params)
    if entries > MAX_LOGPROB_ENTRIES:
        k, tokens = params.prompt_logprobs, sum(len(p) for p in prompts)
        param = "prompt_logprobs" if getattr(req, "prompt_logprobs", None) is not None else "logprobs"
        raise InvalidRequestError(
            f"prompt logprobs would return {entries:,} entries ({tokens:,} prompt tokens x n = "
            f"{params.n} x {k + 1} per position); at most {MAX_LOGPROB_ENTRIES:,} per "
            f"request: ask for fewer alternatives, choices or prompts", param)
    return entries


def relayed_prompt(req, params: SamplingParams) -> tuple[list[PromptTokens], RemotePrefill, str]:
    """generation_only: the prompt arrives from the context worker's answer as an int32
    array (b64), a JSON list (list) or only its length (metadata: whatever reads its values,
    penalties or echo, gets them with its KV, engine/prompt_reads.py); nothing is tokenized
    or rendered again here, and b64 never becomes a Python list."""
    dp = req.disaggregated_params
    dp.check_generation_only()
    if dp.prompt_token_ids_b64 is not None:
        prompt, mode = PromptTokens.from_b64(dp.prompt_token_ids_b64), "b64"
    elif dp.prompt_token_ids is not None:
        prompt, mode = PromptTokens.from_list(dp.prompt_token_ids), "list"
    else:
        if params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs needs the prompt prefilled here, but "
                                      "only prompt_len was relayed", "prompt_logprobs")
        prompt, mode = PromptTokens.placeholder(dp.prompt_len), "metadata"
    if len(prompt) != dp.prompt_len:
        raise InvalidRequestError(f"prompt_len {dp.prompt_len} disagrees with the {len(prompt)} "
                                  f"relayed prompt tokens", "disaggregated_params.prompt_len")
    first = dp.first_gen_tokens or []   # none: a moved stream (its resumed output)
    return [prompt], RemotePrefill(dp.kv_handle, first, dp.first_gen_logprobs), mode


def resumed_output(req, prompts: list[PromptTokens], params: SamplingParams) -> PromptTokens | None:
    """Mid-stream migration: the output another worker streamed before it failed."""
    dp = req.disaggregated_params
    if dp is None or dp.resume_token_ids is None:
        return None
    dp.check_resume()
    if len(prompts) > 1 or params.n > 1 or getattr(req, "echo", False):
        raise InvalidRequestError("a resumed request takes one prompt, n = 1 and no echo",
                                  "disaggregated_params.resume_token_ids")
    return PromptTokens.from_list(dp.resume_token_ids)


def relay_fields(relay: str | None, prompt: PromptTokens) -> dict:
    """context_only: the prompt in the form the orchestrator asked for."""
    if relay == "b64":
        return {"prompt_token_ids_b64": prompt.b64()}     # from the array, never a list
    if relay == "metadata":
        return {}
    return {"prompt_token_ids": prompt.tolist()}
