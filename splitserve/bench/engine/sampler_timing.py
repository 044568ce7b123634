"""`splitserve bench engine --sampler`: the sampler alone, on random logits of the model's
vocabulary, per batch size and kind of row: greedy, sampled without a seed (the sampler's
generator), sampled with a seed (engine/seeded.py), and with `--grammar` greedy rows under a
JSON schema (structured output: the token mask's fill and apply on top of greedy's).
Median milliseconds per call."""

from __future__ import annotations

import statistics
import time

KINDS = ("greedy", "unseeded", "seeded")


def _requests(kind: str, batch: int, position: int) -> list:
    from splitserve.engine.request import Request
    from splitserve.sampling_params import SamplingParams
    from splitserve.tokens import PromptTokens
    # Temperature alone: top-k / top-p cost the same with or without a seed.
    params = {"temperature": 0.0 if kind == "greedy" else 0.8}
    reqs = []
    for i in range(batch):
        seed = {"seed": 1000 + i} if kind == "seeded" else {}
        req = Request(f"r{i}", PromptTokens.from_list([5, 6, 7]),
                      SamplingParams(**params, **seed))
        req.output_token_ids = [9] * position
        reqs.append(req)
    return reqs


# A schema and an answer it allows: each call's rows stand somewhere along the answer.
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"]}
ANSWER = ('{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"], '
          '"address": {"city": "London", "zip": "12345"}}')


def _grammar_requests(engine):
    """(batch, position) -> greedy rows whose matchers stand `position` tokens into ANSWER."""
    import json
    from splitserve.engine.grammar import start_matcher
    from splitserve.protocol.grammar import JSON, GrammarSpec
    template = engine.grammars.compiler.compile(GrammarSpec(JSON, json.dumps(SCHEMA), "bench"))
    ids = engine.tokenizer.encode(ANSWER, add_special_tokens=False).tolist()

    def make(batch: int, position: int) -> list:
        reqs = _requests("greedy", batch, 0)
        for i, req in enumerate(reqs):
            req.grammar = start_matcher(template, ids[:(position + i) % len(ids)])
        return reqs
    return make


def sampler_ms(vocab: int, batch_sizes: list[int], reps: int = 21,
               engine=None) -> dict[str, dict[str, float]]:
    """{kind: {batch size: median ms per sampler call}}; one warm-up call each. With an
    engine, also "json_schema" rows (its tokenizer's grammar, greedy)."""
    import torch
    from splitserve.engine.sampler import Sampler
    sampler, gen = Sampler(vocab, seed=0), torch.Generator().manual_seed(0)
    makers = {k: (lambda b, rep, k=k: _requests(k, b, rep)) for k in KINDS}
    if engine is not None:
        makers["json_schema"] = _grammar_requests(engine)
    out: dict[str, dict[str, float]] = {k: {} for k in makers}
    for b in batch_sizes:
        logits = torch.randn(b, vocab, generator=gen) * 3                     # (B, V)
        for kind, make in makers.items():
            times = []
            for rep in range(reps + 1):
                reqs = make(b, rep)
                t0 = time.perf_counter()
                sampler(logits, reqs)
                if rep:
                    times.append(time.perf_counter() - t0)
            out[kind][str(b)] = 1000 * statistics.median(times)
    return out
