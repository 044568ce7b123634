"""`splitserve bench planner`'s setups, timeline and verdict (bench/planner/main.py)."""

import pytest

from splitserve.bench.planner.main import Setup, attainment, setups, summary

SLO = {"ttft": 1.0}


def test_every_fixed_split_then_the_planner_from_an_even_one():
    assert setups(4, "2:2", None) == [Setup(1, 3), Setup(2, 2), Setup(3, 1),
                                      Setup(2, 2, planner=True)]
    assert setups(4, "1:3", "2:2") == [Setup(2, 2), Setup(1, 3, planner=True)]
    assert Setup(1, 3, planner=True).name == "planner (from 1:3)"
    for bad in ("3:3", "4:0", "x", "2-2"):
        with pytest.raises(ValueError):
            setups(4, bad, None)


def test_attainment_buckets_requests_by_start_and_counts_failures_as_misses():
    reqs = [{"start": 1.0, "ttft": 0.5, "e2e": 1.0}, {"start": 2.0, "ttft": 1.5, "e2e": 2.0},
            {"start": 12.0, "ttft": 0.1, "e2e": 0.2, "error": "timeout"},
            {"start": 15.0, "ttft": 0.1, "e2e": 0.2}]
    assert attainment(reqs, SLO) == [(0.0, 0.5, 2), (10.0, 0.5, 2)]


def run(name, goodput, planner=False, within=1.0):
    return {"setup": name, "planner": planner, "within_slo": within,
            "metrics": {"goodput": goodput}}


def test_the_verdict_is_the_planner_over_the_best_fixed_split():
    s = summary([run("fixed 1:3", 2.0), run("fixed 3:1", 4.0), run("p", 5.6, True, 0.95)])
    assert s["best_fixed"] == "fixed 3:1" and s["ratio"] == pytest.approx(1.4)
    assert s["ratio_pass"] and s["within_pass"]
    s = summary([run("fixed 2:2", 4.0), run("p", 4.4, True, 0.8)])
    assert not s["ratio_pass"] and not s["within_pass"]
