"""OpenAI logprobs shapes (chat, legacy completions, vLLM's prompt_logprobs), built from
the engine's Logprob entries. Token strings come from a `token_text(id) -> str` callable
the caller passes, so this module never touches a tokenizer."""

from __future__ import annotations

from typing import Callable, Sequence

from splitserve.protocol.engine import Logprob

TokenText = Callable[[int], str]
_MIN_LOGPROB = -9999.0   # JSON has no -inf (msgspec writes null); clients expect a float


def _lp(x: float) -> float:
    return x if x > _MIN_LOGPROB else _MIN_LOGPROB   # also maps -inf and nan


def chat_logprobs(entries: Sequence[Logprob], token_text: TokenText, k: int) -> list[dict]:
    """`logprobs.content` of a chat choice: one entry per token with its k alternatives."""
    def entry(token_id: int, logprob: float) -> dict:
        tok = token_text(token_id)
        return {"token": tok, "logprob": _lp(logprob), "bytes": list(tok.encode())}
    out = []
    for e in entries:
        item = entry(e.token_id, e.logprob)
        item["top_logprobs"] = [entry(t, lp) for t, lp in e.top[:k]]
        out.append(item)
    return out


def completion_logprobs(items: Sequence[tuple[int, Logprob | None]], token_text: TokenText,
                        k: int, offset: int) -> tuple[dict, int]:
    """Legacy completions logprobs for (token id, entry) pairs whose text starts at `offset`
    characters into the choice's text; an entry of None (the first echoed prompt token)
    has a null logprob. Returns the dict and the offset after the last token."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, e in items:
        tok = token_text(token_id) if token_id is not None else ""
        tokens.append(tok)
        text_offset.append(offset)
        offset += len(tok)
        if e is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_lp(e.logprob))
        top = {token_text(t): _lp(lp) for t, lp in e.top[:k]}
        top.setdefault(tok, token_logprobs[-1])   # the sampled token is always listed
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}, offset


def vllm_prompt_logprobs(entries: Sequence[Logprob | None], token_text: TokenText) -> list:
    """vLLM's `prompt_logprobs` shape: per prompt token None (the first) or
    {token_id: {logprob, rank, decoded_token}} for the prompt token and its alternatives."""
    out: list = [None] if entries else []
    for e in entries[1:]:
        d = {t: {"logprob": _lp(lp), "rank": r + 1, "decoded_token": token_text(t)}
             for r, (t, lp) in enumerate(e.top)}
        d[e.token_id] = {"logprob": _lp(e.logprob), "rank": e.rank,
                         "decoded_token": token_text(e.token_id)}
        out.append(d)
    return out
