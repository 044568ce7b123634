"""`splitserve bench frontend` against real tiny GEN workers: one whose KV backend is `none`
(the benchmark's target) and one that really pulls KV (which the benchmark must refuse). No timing
ratios are asserted: the machine is shared and noisy."""

import json

import pytest

from server_utils import Worker, get, post
from splitserve.bench.frontend import client as frontend_client
from splitserve.bench.frontend import worker as frontend_worker
from splitserve.cli import main

GEN = ("--model", "tiny-random", "--dtype", "float32", "--role", "gen", "--num-blocks", "2048")
ROW_FIELDS = {"mode", "isl", "concurrency", "max_tokens", "requests", "completed", "errors",
              "truncated_by_duration", "duration_s", "request_throughput", "body_bytes",
              "think_time_s", "mean_in_flight", "server_cpu_s", "server_cpu_per_request_us",
              "engine_cpu_per_request_us", "client_cpu_per_request_us", "gen_preprocessing_ms",
              "queue_ms", "client_latency_ms", "frontends"}
HIST_FIELDS = {"count", "mean_ms", "p50_ms", "p99_ms"}


def bench(url: str, tmp_path, *extra: str) -> dict:
    path = tmp_path / "frontend.json"
    assert main(["--log-level", "WARNING", "bench", "frontend", "--url", url, "--isl", "64,1024",
                 "--concurrency", "4", "--requests", "10", "--min-duration", "0", "--no-progress",
                 "--json", str(path), "--plot", str(tmp_path / "frontend.png"), *extra]) == 0
    return json.loads(path.read_text())


def test_every_mode_runs_against_a_worker_that_skips_kv_pulls(tmp_path):
    worker = Worker(*GEN, "--kv-backend", "none")
    try:
        result = bench(worker.url, tmp_path, "--ramp-up", "0.4", "--think-time", "0.01")
        longer = bench(worker.url, tmp_path, "--modes", "metadata", "--isl", "64",
                       "--min-duration", "0.5")
    finally:
        worker.close()
    # a run that would end in milliseconds keeps sending until --min-duration has passed
    (run,) = longer["runs"]
    assert run["duration_s"] >= 0.45 and run["completed"] > 10
    assert not run["truncated_by_duration"]
    assert result["kv_backend"] == "none" and "skipped" in result["note"]
    # the 4th connection waits 3/4 of the ramp (0.3 s; timers may fire a little early)
    # before its first request; without a ramp a run of 10 takes a few milliseconds
    assert min(r["duration_s"] for r in result["runs"]) >= 0.25
    assert result["worker"]["health"]["kv_backend"] == "none"
    runs = result["runs"]
    assert [(r["mode"], r["isl"], r["concurrency"]) for r in runs] == [
        (m, isl, 4) for isl in (64, 1024) for m in ("metadata", "b64", "list")]
    for r in runs:
        assert set(r) == ROW_FIELDS
        assert r["frontends"] == 1
        assert (r["completed"], r["errors"], r["truncated_by_duration"]) == (10, 0, False)
        assert r["server_cpu_per_request_us"] > 0 and r["client_cpu_per_request_us"] > 0
        assert r["engine_cpu_per_request_us"] is None      # a worker this run did not start
        assert set(r["gen_preprocessing_ms"]) == HIST_FIELDS == set(r["queue_ms"])
        assert r["gen_preprocessing_ms"]["count"] == 10
        assert r["client_latency_ms"]["count"] == 10 and r["request_throughput"] > 0
        assert 0 < r["mean_in_flight"] <= 4
    sizes = {r["mode"]: r["body_bytes"] for r in runs if r["isl"] == 1024}
    assert sizes["metadata"] < sizes["b64"] < sizes["list"]
    assert [t["bound"] for t in result["targets"]] == [1 / 5, 1 / 20, 1.5, 10.0]
    assert all(isinstance(t["pass"], bool) for t in result["targets"])
    assert (tmp_path / "frontend.png").stat().st_size > 0 and result["plot"].endswith(".png")


def test_a_started_worker_is_fresh_for_each_prompt_length(tmp_path):
    path = tmp_path / "frontend.json"
    assert main(["--log-level", "WARNING", "bench", "frontend", "--isl", "16,32", "--modes",
                 "list,metadata", "--concurrency", "2", "--requests", "4", "--min-duration", "0",
                 "--no-progress",
                 "--kv-cache-gib", "0.05", "--json", str(path),
                 "--plot", str(tmp_path / "frontend.png")]) == 0
    result = json.loads(path.read_text())
    urls = result["worker"]["started_per_isl"]
    assert result["worker"]["started_here"] and len(set(urls)) == 2
    assert [(r["mode"], r["isl"]) for r in result["runs"]] == [
        ("metadata", 16), ("list", 16), ("metadata", 32), ("list", 32)]
    assert all(r["engine_cpu_per_request_us"] is not None for r in result["runs"])


def test_refuses_a_worker_that_really_pulls_kv(tmp_path):
    worker = Worker(*GEN, "--kv-timeout", "1")   # a pull to nowhere waits this long
    try:
        _, health = get(worker.url + "/health")
        assert json.loads(health)["kv_backend"] == "tcp"
        # Why it must refuse: the benchmark's KV handle names the `none` backend and points
        # nowhere, so the request fails (cleanly: an error answer, and the worker keeps serving).
        layout, vocab, _ = frontend_worker.tiny_layout(16)
        target = frontend_client.Target(worker.url, "tiny-random", layout, vocab)
        body = b"one".join(frontend_client.body_parts(target, "metadata", 64))
        status, answer = post(worker.url + "/v1/completions", body)
        assert status == 400 and "KV backend 'none'" in answer["error"]["message"]
        assert get(worker.url + "/health")[0] == 200
        with pytest.raises(SystemExit, match="kv_backend 'tcp', not 'none'"):
            bench(worker.url, tmp_path)
    finally:
        worker.close()
