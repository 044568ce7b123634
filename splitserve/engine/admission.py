"""What a request must satisfy before the engine takes it: each check raises
InvalidRequestError naming the parameter, so the front-end answers 400. The prompt's own
check (protocol/prompts.check_prompt) is shared with the worker's front-end, which runs it
before a stream's head leaves."""

from __future__ import annotations

import hmac

import msgspec
import numpy as np

from splitserve.errors import InvalidRequestError
from splitserve.protocol.block_hashes import chain_hashes, prompt_digest
from splitserve.protocol.engine import KVHandle, RequestKind
from splitserve.sampling_params import SamplingParams, sibling_seed
from splitserve.tokens import PromptTokens


def check_length_only(params: SamplingParams, remote) -> None:
    """A length-only prompt's KV comes from a context worker; the values that penalties or
    echo read come with it (prompt_reads.py), but prompt logprobs need the prompt computed."""
    if remote is None:
        raise InvalidRequestError("a length-only prompt needs its KV from a context worker",
                                  "prompt")
    if params.prompt_logprobs is not None:
        raise InvalidRequestError("prompt_logprobs needs the prompt prefilled here, but its KV "
                                  "comes from a context worker", "prompt_logprobs")


def check_relayed_prompt(tokens: np.ndarray, handle: KVHandle, block_size: int,
                         root: bytes = b"") -> list[bytes]:
    """The relayed prompt's full-block hashes (for its prefix caching), once its digest is the
    one the context worker computed for the KV it leased (protocol/block_hashes.py). root:
    the request's salted_root; the context worker's digest was chained from its own, so a
    request whose salt did not reach both workers alike is refused here."""
    param = "disaggregated_params.prompt_token_ids"
    if not handle.prompt_digest:
        raise InvalidRequestError("the KV handle carries no prompt digest to check the relayed "
                                  "prompt against", param)
    hashes = chain_hashes(root, tokens, block_size)
    digest = prompt_digest(tokens, block_size, hashes, root)
    if not hmac.compare_digest(digest, handle.prompt_digest):
        raise InvalidRequestError("the relayed prompt does not match the prompt the context "
                                  "worker prefilled", param)
    return hashes


def check_resumed(prompt: PromptTokens, params: SamplingParams, resumed: np.ndarray,
                  kind: RequestKind, vocab_size: int, max_model_len: int) -> None:
    """Mid-stream migration: output another worker streamed, continued here, recomputed
    with the prompt (aggregated) or pulled with its KV from a draining worker
    (generation_only)."""
    param = "disaggregated_params.resume_token_ids"
    if kind == RequestKind.CONTEXT_ONLY or params.n > 1 or (
            kind == RequestKind.AGGREGATED and prompt.is_placeholder):
        raise InvalidRequestError("a resumed request is an n = 1 request with its prompt's "
                                  "token values, or its KV handle", param)
    if len(resumed) == 0 or int(resumed.min()) < 0 or int(resumed.max()) >= vocab_size:
        raise InvalidRequestError("resume_token_ids must be token ids of this vocabulary", param)
    if len(prompt) + len(resumed) >= max_model_len:
        raise InvalidRequestError("the prompt and resume_token_ids fill the model's context",
                                  param)
    if params.max_tokens is not None and len(resumed) >= params.max_tokens:
        raise InvalidRequestError("resume_token_ids already reach max_tokens", param)


def sibling_params(params: SamplingParams, i: int) -> SamplingParams:
    """Sibling i of an n > 1 request samples with sibling_seed(seed, i)."""
    if params.seed is None:
        return params
    return msgspec.structs.replace(params, seed=sibling_seed(params.seed, i))
