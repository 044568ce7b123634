"""How many logprob entries one response may carry: the bound the worker checks with every
count known (server/admission.py) and the orchestrator with what a body shows
(orchestrator/relay.py), so that both refuse the same request with the same 400.

An entry is a token or one of its k alternatives, with its logprob: each position asked
for is k + 1 entries. Prompt and generation logprobs share the bound, so a response
carrying both stays within it. Bytes per entry, measured on real bodies (tiny model,
SmolLM2's tokenizer, k = 20): chat 86.5 (each token's text, logprob and UTF-8 bytes),
prompt_logprobs ~77, completions ~36; a completions prompt shown by echo and by
prompt_logprobs both ~113. So 2^20 entries are at most ~120 MB, ~90 MB in chat: under half
the orchestrator's 256 MiB answer limit (orchestrator/upstream.py MAX_ANSWER_BYTES), past
which it takes an answer for garbage and runs the request again elsewhere.

A stream's generation logprobs are not bounded: no body is built whole. Each event carries
one token's k + 1 entries per choice and is written as the client reads (the writer waits
for the socket), and the orchestrator relays event by event; a stream without logprobs
may run as long. vLLM likewise bounds only k (--max-logprobs, 20 by default), streamed or
not. Prompt logprobs are bounded in a stream too: they arrive in its first event, whole.
"""

from __future__ import annotations

from typing import Sequence

from splitserve.errors import InvalidRequestError
from splitserve.protocol.openai_requests import ChatCompletionRequest

MAX_LOGPROB_ENTRIES = 1 << 20


def built_whole(req) -> bool:
    """The response is one body: not a stream, and, for a context worker's part of a
    split request, not the prefill of a client's stream (whose GEN streams)."""
    dp = req.disaggregated_params
    return not (req.stream or (dp is not None and dp.client_stream))


def check_generation_logprobs(req, n: int, k: int | None, lengths: Sequence[int],
                              prompt_entries: int = 0) -> None:
    """req: the decoded request (the parameter names the client used); n choices of each
    prompt, up to lengths[i] tokens for prompt i; prompt_entries: the response's prompt
    logprobs, already within the bound. The parameter named is the one to lower: the
    alternatives when that alone is enough, else the length."""
    if k is None or not built_whole(req):
        return
    tokens = n * sum(lengths)
    entries, room = tokens * (k + 1), MAX_LOGPROB_ENTRIES - prompt_entries
    if entries <= room:
        return
    k_param, length_param = _names(req)
    param = k_param if k and tokens <= room else length_param
    plus = f" and {prompt_entries:,} of prompt logprobs" if prompt_entries else ""
    lower = f"{k_param}, {length_param}" if k else length_param
    raise InvalidRequestError(
        f"logprobs would return {entries:,} entries ({tokens:,} tokens generated at most "
        f"x {k + 1} per token){plus}; a response carries at most {MAX_LOGPROB_ENTRIES:,}: "
        f"lower {lower} or n, or stream the response", param)


def _names(req) -> tuple[str, str]:
    """(alternatives, length) as the client spelled them."""
    if isinstance(req, ChatCompletionRequest):
        return "top_logprobs", ("max_completion_tokens" if req.max_completion_tokens is not None
                                else "max_tokens")
    return "logprobs", "max_tokens"
