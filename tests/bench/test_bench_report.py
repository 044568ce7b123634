"""`splitserve bench report` end to end on the tiny model: every section runs the real tools
(engine bench, a worker, `splitserve up`, the front-end bench, plots) and the page comes out
with every section, numbers in its tables, its plots on disk, and no server left running."""

import os
import re

from splitserve import placement
from splitserve.bench.report import main as report
from splitserve.cli import main

NUMBER = r"[\d,]+\.?\d*"


def _servers_on(ports: set[int]) -> list[str]:
    """Command lines of live splitserve processes listening on any of these ports."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "splitserve.cli" in args and any(
                a == "--port" and b.isdigit() and int(b) in ports for a, b in zip(args, args[1:])):
            found.append(" ".join(args))
    return found


def test_report_on_the_tiny_model(tmp_path):
    out = tmp_path / "benchmarks.md"
    assert main(["bench", "report", "--quick", "--model", "tiny-random", "--out", str(out),
                 "--img-dir", str(tmp_path / "img"), "--results-dir", str(tmp_path / "results"),
                 "--frontend-args", "--isl 64 --concurrency 2 --requests 8 --duration 5"]) == 0
    page = out.read_text()

    titles = [f"{i}. {title}" for i, title in enumerate(
        [title for title, _ in report.SECTIONS] + [report.HOWTO], 1)]
    assert re.findall(r"^## (.+)$", page, re.M) == titles
    assert "FAILED" not in page and "failed:" not in page and "missing" not in page
    assert re.search(r"\*\*Summary\.\*\* .*prefills .* tok/s", page)

    helper = placement.plan_worker(placement.usable_cpus()).helper_cpu is not None
    for config in ("float32", "bfloat16", "bfloat16-plain", "int8", "float32-worker",
                   "float32-worker-pytorch",
                   *(["float32-worker-no-helper"] if helper else [])):   # engine: numbers each
        assert re.search(rf"^\| {config} \(\w+ compute[\w ,+]*\) \| {NUMBER} \(\d+ tokens\) \| {NUMBER} "
                         rf"\| {NUMBER} \|", page, re.M), config
    assert re.search(r"C kernels against the same engine in PyTorch .* as throughput ratios: "
                     rf"at \w+, prefill {NUMBER}×", page)
    if helper:
        assert re.search(rf"on the engine's CPU alone: prefill {NUMBER}×, decode b=1 {NUMBER}×",
                         page)
    for c in (1, 16, 64):                                 # one worker: every request succeeded
        assert re.search(rf"^\| {c} \| (\d+) / 0 \| {NUMBER} \| {NUMBER} \| {NUMBER} / ", page,
                         re.M), c
    for target in ("aggregated", "disaggregated"):
        assert re.search(rf"^\| {target}: [^|]+ \| {NUMBER} / {NUMBER} \| {NUMBER} / {NUMBER} \|",
                         page, re.M), target
    assert re.search(r"^\| GEN \| `kv_transfer` \| [1-9]", page, re.M)
    assert re.search(r"^\| orchestrator \| `orchestrator_relay` \| [1-9]", page, re.M)
    assert re.search(r"^\| server CPU/request .* \| (\*\*PASS\*\*|FAIL) \|$", page, re.M)
    for name in ("fleet-o1", "fleet-o2"):         # the fleet: 1 and 2 orchestrator processes
        assert (tmp_path / "results" / f"{name}.json").exists()
    assert re.search(rf"^\| json_schema \| {NUMBER} \| {NUMBER}", page, re.M)   # structured
    assert re.search(rf"JSON-schema requests ran at {NUMBER}× the output tok/s", page)
    assert re.search(rf"^\| json_schema \| {NUMBER} \| {NUMBER} \|$", page, re.M)  # the mask
    assert "TTFT   time to first token" in page          # the metric definitions
    for relay in ("metadata", "b64"):                     # prefix reuse: a hit pulls 4 of 68 blocks
        assert re.search(rf"^\| {relay} \| miss \| 1 \| 68\.0 \| 0\.0 \| {NUMBER} \|", page, re.M)
        assert re.search(rf"^\| {relay} \| hit \| 1 \| 4\.0 \| 64\.0 \| {NUMBER} \|", page, re.M)

    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", page)
    assert {os.path.basename(p) for p in images} >= {"cdf_ttft.png", "cdf_itl.png",
                                                      "vs_concurrency.png", "frontend.png"}
    assert all((tmp_path / p).stat().st_size > 1000 for p in images)
    assert len(images) >= 8     # worker: 3 CDFs + vs concurrency; disagg: 3 CDFs; frontend
    for name in ("engine-float32", "worker-c64", "agg-mixed", "disagg-mixed", "frontend"):
        assert (tmp_path / "results" / f"{name}.json").exists()

    ports = {int(p) for p in re.findall(r"--port (\d+)", page)}
    assert _servers_on(ports | {p + i for p in ports for i in (1, 2)}) == []
