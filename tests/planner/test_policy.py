"""The planner's decision from what it measured (planner/policy.py)."""

from splitserve.planner.policy import PoolView, decide

KNOBS = dict(min_samples=20, headroom=0.7, min_ctx=1, min_gen=1, cooling=False)


def pools(ttft=None, itl=None, ctx=("c1",), gen=("g1", "g2"), samples=100, loads=None):
    loads = loads or {}
    return (PoolView("ctx", {u: loads.get(u, 0.0) for u in ctx}, ttft, samples, 500.0),
            PoolView("gen", {u: loads.get(u, 0.0) for u in gen}, itl, samples, 50.0))


def test_ttft_over_its_slo_moves_the_least_loaded_generation_worker_to_context():
    d = decide(*pools(ttft=900.0, itl=20.0, loads={"g1": 5, "g2": 2}), **KNOBS)
    assert (d.action, d.url, d.src, d.dst) == ("move", "g2", "gen", "ctx")
    assert d.numbers["ttft p90 ms"] == 900.0 and d.numbers["itl p90 ms"] == 20.0
    assert "g2" in d.describe() and "ttft p90 ms 900.0" in d.describe()


def test_itl_over_its_slo_moves_a_context_worker_to_generation():
    d = decide(*pools(ttft=100.0, itl=80.0, ctx=("c1", "c2"), gen=("g1",)), **KNOBS)
    assert (d.action, d.url, d.src, d.dst) == ("move", "c1", "ctx", "gen")


def test_within_slo_both_over_and_cooldown_hold():
    assert decide(*pools(ttft=400.0, itl=40.0), **KNOBS).reason == "within_slo"
    assert decide(*pools(ttft=900.0, itl=80.0), **KNOBS).reason == "both_over_slo"
    assert decide(*pools(ttft=900.0, itl=20.0), **{**KNOBS, "cooling": True}).reason == "cooldown"


def test_the_donor_keeps_its_minimum_and_needs_headroom():
    d = decide(*pools(ttft=900.0, itl=20.0, gen=("g1",)), **KNOBS)
    assert (d.action, d.reason) == ("hold", "gen_at_minimum")
    # 40 ms of a 50 ms SLO is 0.8 > headroom 0.7: the move would push ITL over
    d = decide(*pools(ttft=900.0, itl=40.0), **KNOBS)
    assert (d.action, d.reason) == ("hold", "gen_no_headroom")


def test_too_few_observations_or_no_traffic_judge_nothing():
    assert decide(*pools(ttft=900.0, itl=20.0, samples=5), **KNOBS).reason == "within_slo"
    # no ITL measured (no streams on the GEN pool): nothing says it needs its workers
    d = decide(*pools(ttft=900.0, itl=None), **KNOBS)
    assert (d.action, d.src) == ("move", "gen")
