"""`splitserve bench planner` end to end on two tiny workers: a fixed split and the planner
each serve the swing workload; the JSON, the table and the plot come out."""

import json

from splitserve.cli import main


def test_bench_planner_runs_each_setup_alone_and_writes_json_and_plot(tmp_path, capsys):
    out = tmp_path / "planner.json"
    assert main(["bench", "planner", "--workers", "2", "--duration", "6", "--swing-period", "3",
                 "--input-len", "64", "--output-len", "8", "--concurrency", "2",
                 "--goodput", "ttft:60000", "itl:60000", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["setup"] for r in result["runs"]] == ["fixed 1:1", "planner (from 1:1)"]
    for r in result["runs"]:
        m = r["metrics"]
        assert m["completed"] > 0 and m["failed"] == 0
        assert m["goodput"] == m["request_throughput"]         # every request within 60 s
        assert set(m["slo"]) == {"ttft", "itl"}
        assert r["pool_sizes"] and all(c == 1 and g == 1 for _, c, g in r["pool_sizes"])
        classes = set(r["metrics_by_class"])
        assert classes <= {"input-heavy", "output-heavy"} and "input-heavy" in classes
    assert result["summary"]["ratio"] > 0
    text = capsys.readouterr().out
    assert "planner goodput / best fixed (fixed 1:1)" in text
    assert (tmp_path / "planner.png").stat().st_size > 0
