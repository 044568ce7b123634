"""The report's section against CPU vLLM: what it says without vLLM, the alternating order of
the servers, and the medians, ratios and verdicts it draws from round records as the section
writes them (the servers themselves are never started here: vLLM is a 1 GB install that CI
does not make)."""

import json

import pytest

from splitserve.bench.report.alternate import combine, run_rows, schedule
from splitserve.bench.report.config import ReportConfig
from splitserve.bench.report.reference import REFERENCE, SERVERS, reference
from splitserve.bench.report.reference_page import (order, page, results_table, summary_clause,
                                                    targets, workloads)
from splitserve.bench.serve.compare import rows

WHATS = {"worker": "one `splitserve serve` worker, defaults",
         "disagg": "`splitserve up` (1 CTX + 1 GEN), defaults",
         "prefill": "one `splitserve serve` worker, defaults, one long prompt at a time"}


def _row(server: str, c: int, tok_s: float, ttft: float, itl: float | None,
         itl_p99: float | None) -> dict:
    return {"server": server, "concurrency": c, "completed": 4, "failed": 0,
            "output_throughput": tok_s, "ttft_p50_ms": ttft, "ttft_p99_ms": ttft,
            "itl_mean_ms": itl, "itl_p50_ms": itl, "itl_p99_ms": itl_p99}


def _record(rnd: int, server: str, scale: float) -> dict:
    """One server's round: splitserve's numbers as in _docs of old, vLLM's, each times scale."""
    ours = server == "splitserve"
    worker = ([_row(server, 1, 40.0, 100.0, 20.0, 30.0), _row(server, 8, 140.0, 500.0, 50.0, 60.0)]
              if ours else
              [_row(server, 1, 35.0, 120.0, 25.0, 40.0), _row(server, 8, 100.0, 400.0, 40.0, 80.0)])
    disagg = [_row(server, 8, 50.0, 900.0, 30.0, 30.0) if ours
              else _row(server, 8, 60.0, 800.0, 70.0, 200.0)]
    prefill = [_row(server, 1, 0.4, 2640.0, None, None) if ours
               else _row(server, 1, 0.35, 2750.0, None, None)]

    def scaled(rs):
        return [{**r, **{k: r[k] * scale for k in ("output_throughput", "ttft_p50_ms",
                                                   "itl_mean_ms") if r[k] is not None}}
                for r in rs]
    runs = {"worker": scaled(worker), "disagg": scaled(disagg), "prefill": scaled(prefill)}
    return {"round": rnd, "server": server, "dtype": "float32",
            "starts": [{"process": "vLLM" if server == "vllm" else "serve", "seconds": 300.0 if server == "vllm" and rnd == 0 else 40.0,
                        "settle": {"waited_s": 1.0, "busy_cores": 0.1}}],
            "runs": {label: {"rows": rs, "background": 0.2 + rnd,
                             "workload": {"input_len": isl, "output_len": osl, "seed": 1}}
                     for (label, rs), (isl, osl) in zip(runs.items(),
                                                        ((128, 64), (1900, 64), (2000, 1)))}}


def _records() -> list[dict]:
    """Round 1 (vLLM first) at the base numbers, round 2 (splitserve first) at 1.2x them:
    the medians are 1.1x the base, and the ratios of the medians are the base ratios. Passed
    through JSON, as the section writes and reads them."""
    recs = [_record(0, "vllm", 1.0), _record(0, "splitserve", 1.0),
            _record(1, "splitserve", 1.2), _record(1, "vllm", 1.2)]
    return json.loads(json.dumps(recs))


def test_without_a_vllm_venv_the_section_says_how_to_add_it():
    section = reference(ReportConfig())
    assert section.title == REFERENCE and "--vllm-venv VENV" in section.body
    assert section.summary == ""
    assert "bundled model only" in reference(ReportConfig(model="tiny-random",
                                                          vllm_venv="/nowhere")).body


def test_the_order_alternates_between_rounds():
    assert schedule(SERVERS, 2) == [(0, "vllm"), (0, "splitserve"),
                                    (1, "splitserve"), (1, "vllm")]
    assert [s for _, s in schedule(("a", "b"), 3)] == ["a", "b", "b", "a", "a", "b"]
    with pytest.raises(ValueError, match="at least 2 rounds"):
        schedule(SERVERS, 1)


def test_a_single_run_and_a_sweep_give_the_same_rows():
    run = {"target": {"url": "u", "model": "m"}, "load": {"concurrency": 8, "request_rate": None},
           "metrics": {"completed": 3, "failed": 1, "errors": {}, "output_throughput": 9.0,
                       "ttft_ms": {"p50": 5.0, "p99": 7.0},
                       "itl_ms": {"mean": 2.0, "p50": 2.0, "p99": 3.0}}}
    single = run_rows(run, "vllm")
    assert single == [{**r, "server": "vllm"} for r in rows([run], ["x"])]
    assert single[0]["concurrency"] == 8 and single[0]["ttft_p99_ms"] == 7.0
    assert run_rows({"rows": rows([run], ["x"])}, "vllm") == single


def test_medians_over_the_rounds_and_the_ratio_of_the_medians():
    points = combine(_records(), "splitserve", "vllm")
    assert set(points) == {("worker", 1), ("worker", 8), ("disagg", 8), ("prefill", 1)}
    worker8 = points[("worker", 8)]
    ours = worker8["servers"]["splitserve"]
    assert [r["output_throughput"] for r in ours["rounds"]] == [140.0, 168.0]   # round order
    assert ours["median"]["output_throughput"] == pytest.approx(154.0)
    assert worker8["servers"]["vllm"]["median"]["output_throughput"] == pytest.approx(110.0)
    assert worker8["ratio"]["output_throughput"] == pytest.approx(1.4)
    assert ours["completed"] == 8 and ours["failed"] == 0
    assert points[("prefill", 1)]["ratio"]["itl_mean_ms"] is None      # no ITL at OSL 1


def test_a_failed_round_leaves_a_gap_and_the_median_of_the_others():
    recs = _records()
    recs[3]["runs"]["disagg"] = {"error": "failed: vLLM timed out"}
    point = combine(recs, "splitserve", "vllm")[("disagg", 8)]
    assert point["servers"]["vllm"]["rounds"][1] is None
    assert point["servers"]["vllm"]["median"]["output_throughput"] == 60.0
    text = results_table(combine(recs, "splitserve", "vllm"), recs)
    assert "| disagg | c=8 | vLLM | 4 / 0 | 60.0 (60.0 / –) |" in text
    assert "Failed: round 2, vLLM, disagg: failed: vLLM timed out" in text


def test_the_table_shows_each_round_beside_the_median():
    text = results_table(combine(_records(), "splitserve", "vllm"), _records())
    assert ("| worker | c=8 | splitserve | 8 / 0 | 154.0 (140.0 / 168.0) | 550 (500 / 600) "
            "| 500 (500 / 500) | 55.0 (50.0 / 60.0) | 60.0 (60.0 / 60.0) | 0.7 (0.2 / 1.2) |"
            ) in text
    assert "| worker | c=8 | **ratio** |  | 1.40 | 1.25 | 1.25 | 1.25 | 0.75 |  |" in text
    lines = text.splitlines()
    assert lines.index(next(ln for ln in lines if "| worker | c=1 | vLLM |" in ln)) == 2


def test_each_target_gets_a_verdict():
    verdicts = {line.split(" | ")[1]: line.split(" | ")[-1].rstrip(" |")
                for line in targets(combine(_records(), "splitserve", "vllm")).splitlines()[2:]}
    assert verdicts == {"c=8 output tok/s >= 1.3x vLLM's": "**PASS**",
                        "c=1 ITL avg <= vLLM's": "**PASS**",
                        "c=1 TTFT p50 <= vLLM's": "**PASS**",
                        "c=8 TTFT p50 <= vLLM's": "FAIL",
                        "ITL p99 <= 1/5 of vLLM's": "**PASS**",
                        "output tok/s >= 1.0x vLLM's": "FAIL",
                        "a 2,000-token prompt's TTFT p50 <= vLLM's": "**PASS**"}


def test_the_served_itl_is_held_to_the_engines_own_step():
    points = combine(_records(), "splitserve", "vllm")      # splitserve's c=1 ITL median: 22
    lines = targets(points, 19.0).splitlines()
    assert lines[-1] == ("| worker | c=1 ITL avg <= 1.25x the engine's own decode step | 1.16 "
                         "| **PASS** |")
    assert targets(points, 15.0).splitlines()[-1].endswith("| 1.47 | FAIL |")
    assert "own decode step" not in targets(points, "failed")


def test_the_order_line_names_who_ran_first_in_each_round():
    line = order(_records())
    assert line.startswith("Order: round 1: vLLM (`vLLM` started in 300 s; 0.1 cores busy "
                           "before it), then splitserve (`serve` started in 40 s; 0.1 cores "
                           "busy before it); round 2: splitserve")


def test_the_page_marks_the_default_dtype_and_gives_verdicts_per_dtype():
    bf16 = [{**r, "dtype": "bfloat16"} for r in _records()]
    results = {"float32": {"records": _records(), "step_ms": 19.0},
               "bfloat16": {"records": bf16, "step_ms": "The engine's own decode step: x"}}
    body, summary = page(results, "float32", WHATS, [["splitserve", "serve"]], 1800.0)
    assert "### float32 (this machine's default)" in body and "### bfloat16\n" in body
    assert "default dtype here is **float32**" in body
    assert body.count("a 2,000-token prompt's TTFT p50 <= vLLM's") == 2
    assert "Targets (ratios of the medians), with defaults:" in body
    assert "The section took 30.0 min; vLLM's 4 starts took 300, 40, 300, 40 s" in body
    assert summary.startswith("against CPU vLLM, each server alone (float32")
    assert summary == summary_clause(combine(_records(), "splitserve", "vllm"), "float32", WHATS,
                                     workloads(_records()))
    assert "a 2,000-token prompt takes 0.96x vLLM's TTFT p50" in summary
    assert "one `splitserve serve` worker at c=8 gives 1.40x vLLM's output tok/s" in summary
    assert "**prefill**: one `splitserve serve` worker, defaults, one long prompt at a time, " \
           "prompts of 2,000 tokens, 1 output tokens, seed 1" in body
