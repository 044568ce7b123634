"""Tests hand EngineCore the EngineRequest a front-end would have built."""

from __future__ import annotations

from splitserve.protocol.engine import EngineRequest, RequestKind


def add_request(engine, request_id, prompt, params, *, context_only=False, remote=None,
                stream=True, resumed=None, received_time=None, prompt_back=False,
                hash_root=b"") -> None:
    kind = (RequestKind.CONTEXT_ONLY if context_only else
            RequestKind.GENERATION_ONLY if remote is not None else RequestKind.AGGREGATED)
    request = EngineRequest(request_id, params, len(prompt), prompt.is_placeholder, kind, remote,
                            stream, 0 if resumed is None else len(resumed),
                            prompt_back=prompt_back, hash_root=hash_root)
    engine.add_request(request, prompt, resumed, received_time)


def greedy_tokens(engine, prompts, params) -> list[list[int]]:
    """Runs each prompt (a token array) to the end; each one's generated token ids."""
    from splitserve.tokens import PromptTokens
    for i, p in enumerate(prompts):
        add_request(engine, str(i), PromptTokens(p), params)
    tokens = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
    return [tokens[str(i)] for i in range(len(prompts))]
