"""`splitserve bench engine --sampler`: the sampler alone, on random logits of the model's
vocabulary, per batch size and kind of row: greedy, sampled without a seed (the sampler's
generator), sampled with a seed (engine/seeded.py). Median milliseconds per call."""

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


def sampler_ms(vocab: int, batch_sizes: list[int], reps: int = 21) -> dict[str, dict[str, float]]:
    """{kind: {batch size: median ms per sampler call}}; one warm-up call each."""
    import torch
    from splitserve.engine.sampler import Sampler
    sampler, gen = Sampler(vocab, seed=0), torch.Generator().manual_seed(0)
    out: dict[str, dict[str, float]] = {k: {} for k in KINDS}
    for b in batch_sizes:
        logits = torch.randn(b, vocab, generator=gen) * 3                     # (B, V)
        for kind in KINDS:
            times = []
            for rep in range(reps + 1):
                reqs = _requests(kind, b, rep)
                t0 = time.perf_counter()
                sampler(logits, reqs)
                if rep:
                    times.append(time.perf_counter() - t0)
            out[kind][str(b)] = 1000 * statistics.median(times)
    return out
