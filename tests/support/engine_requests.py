"""Tests hand EngineCore the EngineRequest a front-end would have built."""

from __future__ import annotations

from splitserve.protocol.engine import EngineRequest, RequestKind
from splitserve.tokens import PromptTokens


def add_request(engine, request_id, prompt, params, *, context_only=False, remote=None,
                stream=True, resumed=None, received_time=None, prompt_back=False,
                hash_root=b"", movable=False, peer=0) -> None:
    kind = (RequestKind.CONTEXT_ONLY if context_only else
            RequestKind.GENERATION_ONLY if remote is not None else RequestKind.AGGREGATED)
    if resumed is not None:
        resumed = PromptTokens(resumed)
    request = EngineRequest.build(request_id, prompt, params, kind=kind, remote=remote,
                                  stream=stream, resumed=resumed, prompt_back=prompt_back,
                                  hash_root=hash_root, movable=movable)
    request.received, request.peer = received_time, peer
    engine.add_request(request)


def greedy_tokens(engine, prompts, params) -> list[list[int]]:
    """Runs each prompt (a token array) to the end; each one's generated token ids."""
    for i, p in enumerate(prompts):
        add_request(engine, str(i), PromptTokens(p), params)
    tokens = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
    return [tokens[str(i)] for i in range(len(prompts))]
