"""Local prefill when the context pool is queued: a long prompt goes whole to a generation
worker (an aggregated request: the GEN prefills it in chunks beside its decodes) when the
CTX pool's queued prompt tokens would hold its first token back longer than that GEN would
take to prefill it itself. One CTX worker queueing eight long prompts while its GEN decodes
one stream at a time is the case: the GEN's idle time prefills some of them.

The decision reads only what the load polls keep (cluster.Server: `prefill_tokens`, the
worker's reported prompt tokens still to compute corrected by this orchestrator's requests
since; `running`; `local_prefills`), never a request of its own, so it costs a few
comparisons per request.

Its model counts time in tokens a CTX prefills:
- on the least-queued healthy CTX the prompt's first token comes after the CTX computes
  its queue and the prompt, `ctx.prefill_tokens + n` (a CTX works in arrival order);
- on a GEN after `(gen.prefill_tokens + n) * slowdown`: `slowdown` while the GEN runs
  requests (its steps decode them too, and carry at most --max-prefill-tokens-while-decoding
  prompt tokens, which is what keeps its streams' gaps short), 1 while it runs none.
The prompt goes to the GEN with the lowest such cost when that is lower than the CTX's.
A GEN takes at most MAX_LOCAL_PREFILLS of this orchestrator's whole requests at once, so
the decision never stacks prompts on a GEN before its next report shows them: one prompt
at a time already uses the prefill room its decodes leave."""

from __future__ import annotations

from splitserve.orchestrator.cluster import Server

MAX_LOCAL_PREFILLS = 1


def gen_cost(n: int, gen_queued: int, gen_running: int, slowdown: float) -> float:
    """When a GEN would have a prompt of n tokens prefilled, in CTX prefill tokens."""
    return (gen_queued + n) * (slowdown if gen_running else 1.0)


def gen_is_sooner(n: int, ctx_queued: int, gen_queued: int, gen_running: int,
                  slowdown: float) -> bool:
    """Whether a prompt of n tokens reaches its first token sooner prefilled on a GEN with
    gen_queued prompt tokens to compute and gen_running requests than on a CTX with
    ctx_queued (equal: the split path, which frees the GEN)."""
    return gen_cost(n, gen_queued, gen_running, slowdown) < ctx_queued + n


def pick_gen(n: int, ctx_servers: list[Server], gen_servers: list[Server],
             slowdown: float) -> Server | None:
    """The GEN to prefill a prompt of n tokens on, or None: the split path."""
    ctx = [s.prefill_tokens for s in ctx_servers if s.healthy]
    gens = [s for s in gen_servers if s.healthy and s.local_prefills < MAX_LOCAL_PREFILLS]
    if not ctx or not gens:
        return None
    best = min(gens, key=lambda s: gen_cost(n, s.prefill_tokens, s.running, slowdown))
    return best if gen_is_sooner(n, min(ctx), best.prefill_tokens, best.running,
                                 slowdown) else None
