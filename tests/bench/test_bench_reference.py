"""The report's section against CPU vLLM: what it says without vLLM, and its ratios and
verdicts from `bench serve --compare` rows (the servers themselves are never started here:
vLLM is a 1 GB install that CI does not make)."""

from splitserve.bench.report.config import ReportConfig
from splitserve.bench.report.reference import (REFERENCE, _summary, _table, _vs_first, reference,
                                               targets)


def _row(server: str, c: int, tok_s: float, ttft: float, itl: float, itl_p99: float) -> dict:
    return {"server": server, "concurrency": c, "completed": 4, "failed": 0,
            "output_throughput": tok_s, "ttft_p50_ms": ttft, "ttft_p99_ms": ttft,
            "itl_mean_ms": itl, "itl_p99_ms": itl_p99}


def _docs() -> list[dict]:
    worker = [_row("splitserve", 1, 40.0, 100.0, 20.0, 30.0),
              _row("vllm", 1, 35.0, 120.0, 25.0, 40.0),
              _row("splitserve", 8, 140.0, 500.0, 50.0, 60.0),
              _row("vllm", 8, 100.0, 400.0, 40.0, 80.0)]
    disagg = [_row("splitserve", 8, 50.0, 900.0, 30.0, 30.0),
              _row("vllm", 8, 60.0, 800.0, 70.0, 200.0)]
    return [{"label": "vs-vllm-worker", "what": "worker", "background": 0.2, "rows": worker,
             "workload": {"input_len": 128, "output_len": 64}},
            {"label": "vs-vllm-disagg", "what": "disagg", "background": 0.2, "rows": disagg,
             "workload": {"input_len": 1900, "output_len": 64}},
            {"label": "vs-vllm-prefill", "what": "prefill", "background": 0.2,
             "rows": [_row("splitserve", 1, 0.4, 2640.0, None, None),
                      _row("vllm", 1, 0.35, 2750.0, None, None)],
             "workload": {"input_len": 2000, "output_len": 1}}]


def test_without_a_vllm_venv_the_section_says_how_to_add_it():
    section = reference(ReportConfig())
    assert section.title == REFERENCE and "--vllm-venv VENV" in section.body
    assert section.summary == ""
    assert "bundled model only" in reference(ReportConfig(model="tiny-random",
                                                          vllm_venv="/nowhere")).body


def test_ratios_are_splitserve_over_vllm_at_the_same_load():
    rows = _vs_first(_docs()[0]["rows"])
    assert [r["vs"] is None for r in rows] == [False, True, False, True]
    assert rows[2]["vs"]["output_throughput"] == 1.4
    assert rows[0]["vs"]["itl_mean_ms"] == 0.8
    assert ("| splitserve | c=8 | 4 / 0 | 140.0 | 500 | 500 | 50.0 | 60.0 | 1.40 | 1.25 | 1.25 "
            "| 0.75 |") in _table(_docs()[0])


def test_each_target_gets_a_verdict():
    verdicts = {line.split(" | ")[1]: line.split(" | ")[-1].rstrip(" |")
                for line in targets(_docs()).splitlines()[2:]}
    assert verdicts == {"c=8 output tok/s >= 1.3x vLLM's": "**PASS**",
                        "c=1 ITL avg <= vLLM's": "**PASS**",
                        "c=1 TTFT p50 <= vLLM's": "**PASS**",
                        "c=8 TTFT p50 <= vLLM's": "FAIL",
                        "ITL p99 <= 1/5 of vLLM's": "**PASS**",
                        "output tok/s >= 1.0x vLLM's": "FAIL",
                        "a 2,000-token prompt's TTFT p50 <= vLLM's": "**PASS**"}


def test_the_served_itl_is_held_to_the_engines_own_step():
    lines = targets(_docs(), 17.0).splitlines()
    assert lines[-1] == ("| worker | c=1 ITL avg <= 1.25x the engine's own decode step | 1.18 "
                         "| **PASS** |")
    assert targets(_docs(), 15.0).splitlines()[-1].endswith("| 1.33 | FAIL |")
    assert "own decode step" not in targets(_docs(), "failed")


def test_the_summary_names_the_long_prompt_ratio():
    summary = _summary(_docs())
    assert "a 2,000-token prompt takes 0.96x vLLM's TTFT p50" in summary
    assert "worker at c=8 gives 1.40x vLLM's output tok/s" in summary
