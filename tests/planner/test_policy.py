"""The planner's decision from what it measured (planner/policy.py)."""

from splitserve.planner.policy import PoolView, Scaling, decide

KNOBS = dict(min_samples=20, headroom=0.7, min_ctx=1, min_gen=1, cooling=False)


def pools(ttft=None, itl=None, ctx=("c1",), gen=("g1", "g2"), samples=100, loads=None):
    loads = loads or {}
    return (PoolView("ctx", {u: loads.get(u, 0.0) for u in ctx}, ttft, samples, 500.0),
            PoolView("gen", {u: loads.get(u, 0.0) for u in gen}, itl, samples, 50.0))


def test_ttft_over_its_slo_moves_the_least_loaded_generation_worker_to_context():
    d = decide(*pools(ttft=900.0, itl=20.0, loads={"g1": 5, "g2": 2}), **KNOBS)
    assert (d.action, d.url, d.src, d.dst) == ("move", "g2", "gen", "ctx")
    assert d.numbers["ttft p90 ms"] == 900.0 and d.numbers["itl p90 ms"] == 20.0
    assert "g2" in d.describe() and "ttft p90 ms 900," in d.describe()


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


SCALE = Scaling(max_workers=4, scale_down_below=0.3)


def test_both_over_adds_a_worker_to_the_pool_further_over_where_it_may():
    d = decide(*pools(ttft=900.0, itl=200.0), **KNOBS, scale=SCALE)   # 1.8x and 4x
    assert (d.action, d.dst) == ("add", "gen") and "add a worker to gen" in d.describe()
    d = decide(*pools(ttft=900.0, itl=200.0, ctx=("c1", "c2")), **KNOBS, scale=SCALE)
    assert (d.action, d.reason) == ("hold", "both_over_slo_at_max_workers")


def test_both_far_below_retires_from_the_pool_with_more_room_down_to_the_minimum():
    d = decide(*pools(ttft=100.0, itl=5.0, loads={"g1": 1, "g2": 0}), **KNOBS, scale=SCALE)
    assert (d.action, d.url, d.src) == ("retire", "g2", "gen")   # 0.1 x its SLO vs 0.2 x
    d = decide(*pools(ttft=100.0, itl=5.0, gen=("g1",)), **KNOBS, scale=SCALE)
    assert (d.action, d.reason) == ("hold", "within_slo_at_minimum")
    # one pool at 0.4 of its SLO, or nothing measured (an idle cluster): keep the workers
    assert decide(*pools(ttft=200.0, itl=5.0), **KNOBS, scale=SCALE).reason == "within_slo"
    assert decide(*pools(), **KNOBS, scale=SCALE).reason == "within_slo"
