"""Section 5 of `splitserve bench report`: KV bytes a generation worker pulls per request,
with and without a prefix hit, per token relay mode.

One `splitserve up` cluster (1 CTX + 1 GEN). For each of a few fresh 1,024-token prefixes,
two completions go through the orchestrator: the prefix plus 64 new tokens (a miss: every
block is pulled), then the prefix plus 64 other tokens (a hit: GEN's prefix cache holds the
prefix's blocks, by the hashes CTX sent or, relaying the tokens, its own). What moved is read
from the GEN's /metrics around each request (kv_pulled_bytes_total and friends), so the
numbers are the worker's own count, not an estimate. Prompts are token ids, so blocks align.
"""

from __future__ import annotations

import json
import urllib.request

import numpy as np

from splitserve.bench.report.config import ReportConfig
from splitserve.bench.report.markdown import Section, commands, num, table
from splitserve.bench.report.steps import Service, scrape, tool
from splitserve.bench.server_process import free_port

PREFIX = "Prefix reuse: KV bytes pulled per request, with and without a prefix hit"
PREFIX_LEN, NEW = 1024, 64
VOCAB = 1000       # prompt ids are drawn below this: in the vocabulary of any model served here
METRICS = ("splitserve_kv_pulled_bytes_total", "splitserve_kv_pulled_blocks_total",
           "splitserve_kv_reused_blocks_total", "splitserve_kv_transfer_seconds_sum",
           "splitserve_kv_transfer_seconds_count")


def prefix(cfg: ReportConfig) -> Section:
    reps = 1 if cfg.quick else 3
    port = free_port(3)    # `up --port P`: the orchestrator on P, CTX on P+1, GEN on P+2
    up = tool("up", *cfg.model_args, "--dtype", cfg.serve_dtype, "--port", str(port))
    url, gen = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 2}"
    with Service(up, url, cfg.result("logs/prefix-server.log"), cfg.start_timeout):
        runs = _measure(url, gen, reps)
    rows = [[mode, "hit" if hit else "miss", len(r), num(_mean(r, "blocks"), 1),
             num(_mean(r, "reused"), 1), num(_mean(r, "bytes") / 2**20, 2),
             num(_mean(r, "ms"), 1)] for (mode, hit), r in runs.items()]
    miss, hit = (_mean(runs[("metadata", h)], "bytes") for h in (False, True))
    body = "\n\n".join([
        f"One `splitserve up` cluster (1 CTX + 1 GEN). For each of {reps} fresh "
        f"{PREFIX_LEN:,}-token prefixes, two completions through the orchestrator: the prefix "
        f"plus {NEW} new tokens (a miss), then the prefix plus {NEW} other tokens (a hit); "
        "prompts are token ids, 4 output tokens each. Blocks and bytes are the GEN's own "
        "counters (`/metrics`: `kv_pulled_bytes_total`, `kv_pulled_blocks_total`, "
        "`kv_reused_blocks_total`) read around each request; KV transfer is the mean of its "
        "`kv_transfer_seconds`. `metadata` relays the prompt's length and block hashes; `b64` "
        "relays the tokens, from which the GEN computes the same hashes. Before prefix reuse "
        "every request pulled every block: the miss rows.",
        table(["relay", "prefix", "requests", "blocks pulled", "blocks reused",
               "KV MiB pulled", "KV transfer ms"], rows),
        f"A hit moves {hit / miss:.1%} of a miss's KV bytes in metadata mode.",
        "The report itself (`splitserve/bench/report/prefix.py`) sent the requests to a "
        "cluster started as below. " + commands([up])])
    return Section(PREFIX, body, f"a {PREFIX_LEN:,}-token prefix hit on the GEN cuts the KV "
                   f"pulled per request from {miss / 2**20:.2f} to {hit / 2**20:.2f} MiB")


def _measure(url: str, gen: str, reps: int) -> dict[tuple[str, bool], list[dict]]:
    """(relay mode, prefix hit) -> what each of its requests moved."""
    rng, runs = np.random.default_rng(15), {}
    for mode in ("metadata", "b64"):
        for _ in range(reps):
            shared = rng.integers(3, VOCAB, PREFIX_LEN).tolist()
            for hit in (False, True):
                prompt = shared + rng.integers(3, VOCAB, NEW).tolist()
                runs.setdefault((mode, hit), []).append(_moved(url, gen, prompt, mode))
    return runs


def _moved(url: str, gen: str, prompt: list[int], mode: str) -> dict:
    """One completion through the orchestrator, and what the GEN pulled for it."""
    before = _counters(gen)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "token_relay": mode}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        json.loads(r.read())
    after = _counters(gen)
    d = {k: after[k] - before[k] for k in METRICS}
    pulls = d["splitserve_kv_transfer_seconds_count"] or 1
    return {"bytes": d["splitserve_kv_pulled_bytes_total"],
            "blocks": d["splitserve_kv_pulled_blocks_total"],
            "reused": d["splitserve_kv_reused_blocks_total"],
            "ms": 1000 * d["splitserve_kv_transfer_seconds_sum"] / pulls}


def _counters(gen: str) -> dict[str, float]:
    metrics = scrape(gen)
    return {k: metrics.get((k, frozenset()), 0.0) for k in METRICS}


def _mean(runs: list[dict], key: str) -> float:
    return sum(r[key] for r in runs) / len(runs)
