"""The GPU check's last step: `splitserve up` (one CTX and one GEN sharing the device, KV
over tcp) against one aggregated worker on the same model, greedy chats through each."""

from __future__ import annotations

import json
import time
import urllib.request

from splitserve.bench.report.steps import Service, scrape, tool
from splitserve.bench.server_process import free_port

CHATS = ("What is the capital of France?", "Count from one to ten.",
         "Write a haiku about the sea.", "Explain what a KV cache is.")
TRANSFER = ("splitserve_kv_transfer_seconds_sum", "splitserve_kv_transfer_seconds_count")


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def answers(url: str, max_tokens: int = 24) -> list[str]:
    return [_post(url, {"messages": [{"role": "user", "content": c}], "max_tokens": max_tokens,
                        "temperature": 0, "ignore_eos": True})["choices"][0]["message"]["content"]
            for c in CHATS]


def _transfer(gen: str) -> tuple[float, float]:
    m = scrape(gen)
    return tuple(m.get((k, frozenset()), 0.0) for k in TRANSFER)


def _wait_joined(url: str, timeout: float = 300) -> None:
    """Until the orchestrator counts a healthy CTX and GEN: up answers /health before."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            healthy = json.loads(r.read()).get("healthy", {})
        if healthy.get("ctx") and healthy.get("gen"):
            return
        time.sleep(0.5)
    raise TimeoutError(f"{url}: no CTX and GEN joined in {timeout:.0f} s")


def step_up(model_flags: list[str], device_flags: list[str], fraction: str, logs: str) -> bool:
    share = ["--gpu-memory-utilization", fraction] if fraction else []
    port = free_port(3)      # up --port P: the orchestrator on P, CTX on P+1, GEN on P+2
    agg = tool("serve", *model_flags, *device_flags, *share, "--port", str(port))
    with Service(agg, f"http://127.0.0.1:{port}", f"{logs}/agg.log", 300) as s:
        want = answers(s.url)
    up = tool("up", *model_flags, *device_flags, *share, "--kv-backend", "tcp",
              "--port", str(port))
    gen = f"http://127.0.0.1:{port + 2}"
    with Service(up, f"http://127.0.0.1:{port}", f"{logs}/up.log", 300) as s:
        _wait_joined(s.url)
        before = _transfer(gen)
        got = answers(s.url)
        after = _transfer(gen)
    pulls = after[1] - before[1]
    ms = 1000 * (after[0] - before[0]) / pulls if pulls else float("nan")
    same = sum(a == b for a, b in zip(want, got))
    print(f"up: {same}/{len(CHATS)} greedy chats through the orchestrator (CTX + GEN, KV over "
          f"tcp) equal to the aggregated worker's; {pulls:.0f} KV pulls, {ms:.2f} ms per request")
    return same == len(CHATS) and pulls == len(CHATS)
