"""Goodput bounds (vLLM's --goodput form) and the swing workload (bench/serve)."""

import pytest

from splitserve.bench import metrics as M
from splitserve.bench.serve.workloads import WorkloadConfig, sessions


def record(ttft, gaps, out):
    e2e = ttft + sum(gaps)
    return M.RequestRecord(cls="default", ttft=ttft, e2e=e2e, itl=gaps, output_tokens=out,
                           prompt_tokens=8)


def test_goodput_takes_vllm_keys_in_milliseconds():
    assert M.parse_goodput(["ttft:500", "tpot:50", "e2el:2000", "itl:80"]) == {
        "ttft": 0.5, "tpot": 0.05, "e2e": 2.0, "itl": 0.08}
    for bad in (["ttft=500"], ["speed:5"], ["ttft:-1"], ["ttft:x"], ["ttft:nan"]):
        with pytest.raises(ValueError, match="--goodput takes KEY:MS"):
            M.parse_goodput(bad)


def test_itl_bounds_every_gap_where_tpot_bounds_their_mean():
    steady = record(0.1, [0.02] * 10, 11)
    spiky = record(0.1, [0.01] * 9 + [0.1], 11)      # mean 0.019 s, one 100 ms gap
    itl, tpot = {"itl": 0.05}, {"tpot": 0.05}
    assert M.meets_slo(steady, itl) and M.meets_slo(steady, tpot)
    assert M.meets_slo(spiky, tpot) and not M.meets_slo(spiky, itl)
    summary = M.summarize([steady, spiky], 1.0, itl)
    assert summary["goodput"] == 1.0 and summary["completed"] == 2


def test_swing_swaps_the_lengths_every_period():
    now = [0.0]
    cfg = WorkloadConfig(kind="swing", input_len=40, output_len=4, swing_period=10.0, seed=1)
    stream = sessions(cfg, clock=lambda: now[0])
    shapes = []
    for t in (0.0, 5.0, 10.0, 19.0, 20.0, 35.0):
        now[0] = t
        turn = next(stream).turns[0]
        shapes.append((turn.input_len, turn.output_len, turn.cls, len(turn.prompt)))
    assert shapes == [(40, 4, "input-heavy", 40), (40, 4, "input-heavy", 40),
                      (4, 40, "output-heavy", 4), (4, 40, "output-heavy", 4),
                      (40, 4, "input-heavy", 40), (4, 40, "output-heavy", 4)]
    with pytest.raises(ValueError, match="--swing-period"):
        WorkloadConfig(kind="swing", swing_period=0)
