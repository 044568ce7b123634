"""The planner's decision, a pure function of what it measured (unit-tested alone).

The context pool's TTFT p90 and the generation pool's ITL p90, each against its SLO, are
the two pressures. One pool over its SLO while the other has headroom (below `headroom` x
its SLO, or no SLO or no traffic to measure): move the least-loaded worker of the other pool
to it, keeping at least min_ctx / min_gen. Both over: no move can help; where the planner
may start workers (`scale`: `up --planner --max-workers`) it adds one to the pool further
over its SLO, else it says so. Both measured below `scale_down_below` x their SLOs (a pool
without an SLO counts as below): it retires the least-loaded worker of the pool with more
room, down to min_ctx + min_gen; an idle cluster (nothing measured) keeps its workers.
After a change the planner waits `cooldown` seconds and reads a fresh window, so it judges
the change by what came after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PoolView:
    name: str                        # "ctx" or "gen"
    loads: dict[str, float]          # member url -> requests running + waiting
    p90_ms: float | None             # TTFT (ctx) or ITL (gen) p90 in the window
    samples: int                     # observations behind it
    slo_ms: float | None


@dataclass(frozen=True)
class Scaling:
    """Where the planner may start and stop workers: how many at most, and below which
    fraction of both SLOs it retires one."""
    max_workers: int
    scale_down_below: float


@dataclass(frozen=True)
class Decision:
    action: str                      # "move", "add", "retire" or "hold"
    reason: str                      # a hold's reason is also its metric label
    url: str | None = None           # a move's worker from src to dst; a retired one's
                                     # from src; an added one goes to dst
    src: str | None = None
    dst: str | None = None
    numbers: dict = field(default_factory=dict)

    def describe(self) -> str:
        shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in self.numbers.items())
        head = {"move": f"move {self.url} from {self.src} to {self.dst}: {self.reason}",
                "add": f"add a worker to {self.dst}: {self.reason}",
                "retire": f"retire {self.url} from {self.src}: {self.reason}",
                }.get(self.action, f"hold: {self.reason}")
        return f"{head} ({shown})" if shown else head


def pressure(pool: PoolView, min_samples: int) -> float | None:
    """p90 / SLO; None without an SLO or with too few observations to judge."""
    if pool.slo_ms is None or pool.p90_ms is None or pool.samples < min_samples:
        return None
    return pool.p90_ms / pool.slo_ms


def decide(ctx: PoolView, gen: PoolView, *, min_samples: int, headroom: float,
           min_ctx: int, min_gen: int, cooling: bool, scale: Scaling | None = None) -> Decision:
    over = {p.name: pressure(p, min_samples) for p in (ctx, gen)}
    numbers = {"ctx workers": len(ctx.loads), "gen workers": len(gen.loads)}
    for p, what in ((ctx, "ttft"), (gen, "itl")):
        if p.p90_ms is not None:
            numbers[f"{what} p90 ms"] = p.p90_ms
            numbers[f"{what} slo ms"] = p.slo_ms if p.slo_ms is not None else "none"
            numbers[f"{what} samples"] = p.samples
    if cooling:
        return Decision("hold", "cooldown", numbers=numbers)
    missing = [name for name, x in over.items() if x is not None and x > 1]
    if not missing:
        if scale is not None:
            return _scale_down(ctx, gen, over, scale, min_ctx, min_gen, numbers)
        return Decision("hold", "within_slo", numbers=numbers)
    if len(missing) == 2:
        if scale is None:
            return Decision("hold", "both_over_slo", numbers=numbers)
        if len(ctx.loads) + len(gen.loads) >= scale.max_workers:
            return Decision("hold", "both_over_slo_at_max_workers", numbers=numbers)
        needy = max((ctx, gen), key=lambda p: over[p.name])
        return Decision("add", "both pools over their SLOs", dst=needy.name, numbers=numbers)
    needy, donor = (ctx, gen) if missing == ["ctx"] else (gen, ctx)
    spare = over[donor.name]
    if len(donor.loads) <= (min_gen if donor is gen else min_ctx):
        return Decision("hold", f"{donor.name}_at_minimum", numbers=numbers)
    if spare is not None and spare > headroom:
        return Decision("hold", f"{donor.name}_no_headroom", numbers=numbers)
    url = min(donor.loads, key=lambda u: (donor.loads[u], u))
    what = "ttft" if needy is ctx else "itl"
    return Decision("move", f"{needy.name} {what} p90 over its SLO", url, donor.name,
                    needy.name, numbers)


def _scale_down(ctx: PoolView, gen: PoolView, over: dict, scale: Scaling, min_ctx: int,
                min_gen: int, numbers: dict) -> Decision:
    measured = {p.name: over[p.name] if p.slo_ms is not None else 0.0 for p in (ctx, gen)}
    if any(x is None for x in measured.values()) or \
            max(measured.values()) >= scale.scale_down_below:
        return Decision("hold", "within_slo", numbers=numbers)
    spare = [p for p, floor in ((ctx, min_ctx), (gen, min_gen)) if len(p.loads) > floor]
    if not spare:
        return Decision("hold", "within_slo_at_minimum", numbers=numbers)
    pool = min(spare, key=lambda p: (measured[p.name], -len(p.loads)))
    url = min(pool.loads, key=lambda u: (pool.loads[u], u))
    return Decision("retire", f"both pools below {scale.scale_down_below:g} x their SLOs",
                    url, pool.name, numbers=numbers)
