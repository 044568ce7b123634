"""A prefix-cache poisoning attempt against real worker processes: the KV a CTX computed for
prompt P1, offered to a GEN under prompt P2's tokens, is refused with a 400; afterwards P2 and
a prompt sharing its prefix decode (disaggregated, and on the GEN itself, where its prefix
cache serves them) exactly as an aggregated reference does."""

import base64
import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from server_utils import Orchestrator, Worker, internal, metrics

MODEL = ("--model", "tiny-random", "--dtype", "float32")
rng = np.random.default_rng(13)
P1, P2 = (rng.integers(3, 1000, 40).tolist() for _ in range(2))
SHARES = P2[:32] + rng.integers(3, 1000, 9).tolist()   # two of P2's blocks of 16, then its own
BODY = {"model": "tiny-random", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def post(url: str, body: dict) -> tuple[int, dict]:
    """With the worker's internal token, as the orchestrator sends it."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", **internal(url)})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def complete(url: str, prompt: list[int], **extra) -> tuple[int, dict]:
    return post(url + "/v1/completions", {**BODY, "prompt": prompt, **extra})


def text(url: str, prompt: list[int], **extra) -> str:
    status, answer = complete(url, prompt, **extra)
    assert status == 200, answer
    return answer["choices"][0]["text"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    started = []   # server_utils gives them all its internal secret
    try:
        started.append(Worker(*MODEL, "--role", "ctx"))
        started.append(Worker(*MODEL, "--role", "gen"))
        ctx, gen = started
        started.append(Orchestrator(tmp_path_factory.mktemp("integrity"), [ctx.url], [gen.url]))
        yield started
    finally:
        for p in reversed(started):
            p.close()


def test_forged_prompt_tokens_are_refused_and_poison_nothing(cluster):
    ctx, gen, orch = cluster
    want = {name: text(ctx.url, p) for name, p in (("p2", P2), ("shares", SHARES))}
    status, answer = complete(ctx.url, P1, disaggregated_params={
        "request_type": "context_only", "token_relay": "list"})
    assert status == 200 and answer["disaggregated_params"]["prompt_token_ids"] == P1
    dp = {**answer["disaggregated_params"], "request_type": "generation_only"}
    b64 = base64.b64encode(np.asarray(P2, "<i4").tobytes()).decode()
    for forged in ({"prompt_token_ids": P2},
                   {"prompt_token_ids": None, "prompt_token_ids_b64": b64}):
        status, err = complete(gen.url, P2, disaggregated_params={**dp, **forged})
        assert status == 400, err
        assert err["error"]["param"] == "disaggregated_params.prompt_token_ids"
        assert "does not match the prompt the context worker prefilled" in err["error"]["message"]
    m = metrics(gen.url)
    assert m["splitserve_kv_blocks_used"] == 0
    # Disaggregated through the orchestrator: the GEN caches P2's pulled blocks.
    for name, p in (("p2", P2), ("shares", SHARES)):
        assert text(orch.url, p, token_relay="list") == want[name]
    # On the GEN itself its prefix cache serves P2's blocks: they must be P2's KV.
    hits = m.get("splitserve_prefix_cache_hits_total", 0)
    for name, p in (("p2", P2), ("shares", SHARES)):
        assert text(gen.url, p) == want[name]
    assert metrics(gen.url).get("splitserve_prefix_cache_hits_total", 0) > hits
