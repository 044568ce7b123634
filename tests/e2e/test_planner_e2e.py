"""`splitserve up --planner`: the planner moves a worker between the pools while the
cluster serves, and no request fails (splitserve/planner/)."""

import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from server_utils import CLIENT, UpCluster, get, metrics, stream, wait_for

BODY = {"model": "tiny-random", "max_tokens": 4, "temperature": 0}


def members(up) -> dict[str, str]:
    with CLIENT.urlopen(urllib.request.Request(up.url + "/internal/workers"), 10) as r:
        return {m["url"]: m["role"] for m in json.loads(r.read())["data"]}


def retried(up) -> float:
    return sum(v for k, v in metrics(up.url).items()
               if k.startswith("splitserve_orchestrator_retries_total"))


def burst(up, start: int, n: int) -> list[str]:
    """n streamed completions of distinct prompts at once: each one's last event."""
    def one(i: int) -> str:
        events = stream(up.url + "/v1/completions", {**BODY, "prompt": f"request {i} " * 8})
        assert events[-1] == "[DONE]" and "error" not in events[-2], events[-2:]
        return events[-2]["choices"][0]["finish_reason"]
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(start, start + n)))


def serve_until(up, done, what: str, timeout: float = 180.0) -> None:
    """Bursts of requests, every one answered in full, until done() (a change the planner
    makes under that load)."""
    deadline, sent = time.monotonic() + timeout, 0
    while not done():
        assert time.monotonic() < deadline, what
        assert set(burst(up, sent, 16)) == {"length"}
        sent += 16


def planner_cluster(tmp_path, *args: str):
    """`up --planner` on the tiny model, looking every 0.3 s; (the cluster, its log)."""
    log = tmp_path / "up.log"
    return UpCluster("--model", "tiny-random", "--planner", "--planner-interval", "0.3", *args,
                     log=log, log_level="INFO"), log


def test_ttft_over_its_slo_moves_a_generation_worker_to_context(tmp_path):
    # Any prefill misses a 0.001 ms TTFT; no ITL SLO can be missed at 100 s.
    up, log = planner_cluster(tmp_path, "--num-ctx", "1", "--num-gen", "2", "--ctx-router",
                              "least_loaded", "--ttft-p90-ms", "0.001", "--itl-p90-ms", "100000",
                              "--planner-window", "30", "--planner-cooldown", "600")
    try:
        before = members(up)
        assert sorted(before.values()) == ["context", "generation", "generation"]
        serve_until(up, lambda: list(members(up).values()).count("context") == 2,
                    "the planner moved no worker")
        after = members(up)
        moved = [u for u in after if after[u] != before[u]]
        assert len(moved) == 1 and before[moved[0]] == "generation"
        text = log.read_text()
        assert re.search(rf"planner: move {re.escape(moved[0])} from gen to ctx: ctx ttft p90 "
                         r"over its SLO \(.*ttft p90 ms [\d.]+", text), text[-3000:]
        # The moved worker prefills now; the generation worker left pulls its KV.
        wait_for(lambda: up.joined() == {"ctx": 2, "gen": 1}, 30, "the pools after the move")
        prompts = metrics(moved[0]).get("splitserve_prompt_tokens_total", 0.0)
        retries = retried(up)
        assert set(burst(up, 1000, 32)) == {"length"}
        assert metrics(moved[0])["splitserve_prompt_tokens_total"] > prompts
        assert retried(up) == retries     # every pull from it worked the first time
        # One move, counted on the planner's /metrics; the cooldown holds the rest.
        port = re.search(r"planner: .* metrics on http://127\.0\.0\.1:(\d+)", text).group(1)
        planner = metrics(f"http://127.0.0.1:{port}")
        assert planner['splitserve_planner_moves_total{from="gen",to="ctx"}'] == 1
        assert get(f"http://127.0.0.1:{port}/health")[0] == 200
        up.interrupt()
    finally:
        up.close()


def test_both_pools_over_their_slos_the_planner_adds_workers_up_to_max_workers(tmp_path):
    up, log = planner_cluster(tmp_path, "--num-ctx", "1", "--num-gen", "1", "--ttft-p90-ms",
                              "0.001", "--itl-p90-ms", "0.001", "--max-workers", "3",
                              "--planner-cooldown", "1")
    try:
        serve_until(up, lambda: len(members(up)) == 3, "the planner added no worker")
        text = log.read_text()
        assert "planner: add a worker to" in text and "for the planner" in text
        wait_for(lambda: sum(up.joined().values()) == 3, 60, "the added worker healthy")
        assert set(burst(up, 5000, 16)) == {"length"}
        # at the limit it holds, and says why
        wait_for(lambda: "both_over_slo_at_max_workers" in log.read_text(), 30, "the hold")
        assert "every one of the 3 slots is taken" not in log.read_text()
        up.interrupt()
    finally:
        up.close()


def test_both_pools_far_within_their_slos_the_planner_retires_a_worker(tmp_path):
    up, log = planner_cluster(tmp_path, "--num-ctx", "1", "--num-gen", "2", "--ttft-p90-ms",
                              "600000", "--itl-p90-ms", "600000", "--max-workers", "3",
                              "--planner-cooldown", "600")
    try:
        before = members(up)
        serve_until(up, lambda: len(members(up)) == 2, "the planner retired no worker")
        gone = set(before) - set(members(up))
        assert len(gone) == 1 and before[gone.pop()] == "generation"
        wait_for(lambda: " retired (exited with code 0)" in log.read_text(), 60,
                 "the retired worker's exit")
        assert set(burst(up, 5000, 16)) == {"length"}
        time.sleep(2)     # it is not started again
        assert len(members(up)) == 2 and "restarting it" not in log.read_text()
        up.interrupt()
    finally:
        up.close()
