"""OpenAI logprobs shapes (chat, legacy completions, vLLM's prompt_logprobs), built from
the engine's Logprob entries: as dicts for a stream's events, as JSON encoded piece by
piece for a whole response's choices (the *_json functions). Token strings come from a
`token_text(id) -> str` callable the caller passes, so this module never touches a
tokenizer."""

from __future__ import annotations

from typing import Callable, Sequence

import msgspec

from splitserve.protocol.engine import Logprob

TokenText = Callable[[int], str]
_MIN_LOGPROB = -9999.0   # JSON has no -inf (msgspec writes null); clients expect a float
_encode = msgspec.json.Encoder().encode
# Positions shaped and encoded at a time for a whole response (the *_json functions): the
# thread building a body of a million entries holds the GIL for one piece at a time (msgspec
# encodes without letting go: 256 chat positions at k = 20 are ~380 KB, ~2.5 ms on a busy
# 2-core machine), and only one piece's dicts are alive at once.
PIECE = 256
_COMPLETION_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


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


def vllm_prompt_entry(e: Logprob, token_text: TokenText) -> dict:
    """vLLM's `prompt_logprobs` shape (the first prompt token's is None): {token_id:
    {logprob, rank, decoded_token}} for the prompt token and its alternatives."""
    d = {t: {"logprob": _lp(lp), "rank": r + 1, "decoded_token": token_text(t)}
         for r, (t, lp) in enumerate(e.top)}
    d[e.token_id] = {"logprob": _lp(e.logprob), "rank": e.rank,
                     "decoded_token": token_text(e.token_id)}
    return d


# -- a whole choice's, encoded piece by piece ----------------------------------------------
def chat_logprobs_json(entries: Sequence[Logprob], token_text: TokenText, k: int) -> msgspec.Raw:
    """A chat choice's `logprobs`: {"content": chat_logprobs(...)} as JSON."""
    pieces = _pieces(entries, lambda part: chat_logprobs(part, token_text, k))
    return msgspec.Raw(b'{"content":' + _array(pieces) + b"}")


def completion_logprobs_json(items: Sequence[tuple[int, Logprob | None]],
                             token_text: TokenText, k: int) -> msgspec.Raw:
    """A completions choice's `logprobs` (completion_logprobs from offset 0) as JSON."""
    lists: dict[str, list[bytes]] = {key: [] for key in _COMPLETION_KEYS}
    offset = 0
    for i in range(0, len(items), PIECE):
        d, offset = completion_logprobs(items[i:i + PIECE], token_text, k, offset)
        for key in _COMPLETION_KEYS:
            lists[key].append(_encode(d[key])[1:-1])
    return msgspec.Raw(b"{" + b",".join(b'"%s":%s' % (key.encode(), _array(lists[key]))
                                        for key in _COMPLETION_KEYS) + b"}")


def vllm_prompt_logprobs_json(entries: Sequence[Logprob | None],
                              token_text: TokenText) -> msgspec.Raw:
    """A choice's `prompt_logprobs` (vllm_prompt_entry each, null for the first) as JSON."""
    if not entries:
        return msgspec.Raw(b"[]")
    rest = _pieces(entries[1:], lambda part: [vllm_prompt_entry(e, token_text) for e in part])
    return msgspec.Raw(_array([b"null", *rest]))


def _pieces(items: Sequence, build: Callable[[Sequence], list]) -> list[bytes]:
    """build(piece) for each PIECE items, each encoded as a JSON array's elements."""
    return [_encode(build(items[i:i + PIECE]))[1:-1] for i in range(0, len(items), PIECE)]


def _array(pieces: list[bytes]) -> bytes:
    return b"[" + b",".join(pieces) + b"]"
