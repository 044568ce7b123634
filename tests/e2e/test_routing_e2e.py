"""Where prompts are prefilled and which context worker gets them, on real processes:
short prompts skip CTX (the orchestrator's metric, CTX's request count and GEN's KV pulls
all say so) with the same greedy output; a GEN that holds a prompt prefills it itself; a
repeated long prefix goes to the CTX that holds it."""

import base64

import numpy as np
import pytest

from server_utils import Orchestrator, Worker, call, internal, metrics, post, wait_for
from splitserve.orchestrator import relay
from splitserve.orchestrator.cluster import Server
from splitserve.orchestrator.routers import rendezvous
from splitserve.protocol.block_hashes import chain_hashes

MODEL = ("--model", "tiny-random", "--dtype", "float32")
THRESHOLD = 32
BLOCK = 16     # the workers' block size (serve's default)


@pytest.fixture(scope="module")
def workers():
    procs = [Worker(*MODEL, "--role", role) for role in ("ctx", "ctx", "gen")]
    yield procs
    for p in procs:
        p.close()


@pytest.fixture(scope="module")
def conditional(workers, tmp_path_factory):
    ctx, _, gen = workers
    orch = Orchestrator(tmp_path_factory.mktemp("cond"), [ctx.url], [gen.url],
                        local_prefill_max_tokens=THRESHOLD, model="tiny-random")
    yield ctx, gen, orch
    orch.close()


@pytest.fixture(scope="module")
def kv_aware(workers, tmp_path_factory):
    ctx1, ctx2, gen = workers
    orch = Orchestrator(tmp_path_factory.mktemp("kv"), [ctx1.url, ctx2.url], [gen.url],
                        ctx_router="kv_aware", model="tiny-random")
    yield ctx1, ctx2, gen, orch
    orch.close()


def ids(n, seed):
    return np.random.default_rng(seed).integers(3, 40000, n).tolist()


def completion(prompt, **extra):
    return {"model": "tiny-random", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, **extra}


def counts(ctx, gen, orch) -> dict[str, float]:
    c, g, o = metrics(ctx.url), metrics(gen.url), metrics(orch.url)
    out = {"ctx_requests": sum(v for k, v in c.items()
                               if k.startswith("splitserve_requests_total{") and "/v1/" in k),
           "gen_kv_pulls": g.get("splitserve_kv_transfer_seconds_count", 0.0)}
    out.update({k.partition("{")[2].rstrip("}"): v for k, v in o.items()
                if k.startswith("splitserve_orchestrator_prefill_total{")})
    return out


def moved(before, after) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


def gen_route(reason):
    return f'where="gen",reason="{reason}"'


def direct(url, path, body) -> str:
    status, answer = post(url + path, body)
    assert status == 200, answer
    c = answer["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", completion("The capital of France is")),
    ("/v1/completions", completion(ids(THRESHOLD, 1))),
    ("/v1/chat/completions", {**completion(None), "prompt": None,
                              "messages": [{"role": "user", "content": "Hi!"}]})])
def test_short_prompts_skip_ctx_with_the_same_output(conditional, path, body):
    ctx, gen, orch = conditional
    body = {k: v for k, v in body.items() if v is not None}
    before = counts(ctx, gen, orch)
    got = direct(orch.url, path, body)
    assert moved(before, counts(ctx, gen, orch)) == {gen_route("short_prompt"): 1}
    assert got == direct(gen.url, path, body)


def test_long_prompts_still_go_through_ctx(conditional):
    ctx, gen, orch = conditional
    body = completion(ids(THRESHOLD + 1, 2))
    before = counts(ctx, gen, orch)
    got = direct(orch.url, "/v1/completions", body)
    assert moved(before, counts(ctx, gen, orch)) == {
        "ctx_requests": 1, "gen_kv_pulls": 1, 'where="ctx",reason="long_prompt"': 1}
    assert got == direct(gen.url, "/v1/completions", body)


def kv_blocks(url, **headers) -> tuple[int, dict]:
    status, body, _ = call("GET", url + "/internal/kv_blocks", headers=headers or internal(url))
    return status, body


def held_by(url, prompt) -> int | None:
    """How many hashes the worker reports, once they include every full block of prompt."""
    body = kv_blocks(url)[1]
    raw = base64.b64decode(body["hashes"])
    held = {raw[i:i + 16] for i in range(0, len(raw), 16)}
    whole = set(chain_hashes(b"", np.array(prompt, dtype=np.int32), BLOCK)) <= held
    return len(held) if whole else None


def seed(worker, orch, prompt):
    """worker prefills prompt (sent to it whole) and orch has read the report saying so."""
    direct(worker.url, "/v1/completions", completion(prompt))
    wait_for(lambda: held_by(worker.url, prompt) is not None, 10, "the worker reports it")
    n = held_by(worker.url, prompt)      # no other request runs: this report stays
    key = f'splitserve_orchestrator_kv_index_blocks{{server="{worker.url}"}}'
    wait_for(lambda: metrics(orch.url).get(key) == n, 10, "the orchestrator reads it")


def test_kv_blocks_is_internal_and_answers_unchanged(workers):
    gen = workers[2]
    status, body = kv_blocks(gen.url, Authorization="Bearer x")
    assert status == 403
    status, body = kv_blocks(gen.url)
    assert status == 200 and body["block_size"] == BLOCK
    status, again, _ = call("GET", f"{gen.url}/internal/kv_blocks?since={body['version']}",
                            headers=internal(gen.url))
    assert again == {"version": body["version"], "unchanged": True}


def test_a_gen_holding_most_of_the_prompt_prefills_it(conditional):
    ctx, gen, orch = conditional
    prompt = ids(6 * BLOCK, 3)
    seed(gen, orch, prompt)
    body = completion(prompt + ids(5, 4))        # all but 5 (+ the last block's) tokens held
    before = counts(ctx, gen, orch)
    got = direct(orch.url, "/v1/completions", body)
    assert moved(before, counts(ctx, gen, orch)) == {gen_route("gen_prefix_hit"): 1}
    assert got == direct(gen.url, "/v1/completions", body)


def test_a_repeated_long_prefix_goes_to_the_ctx_that_holds_it(kv_aware):
    ctx1, ctx2, gen, orch = kv_aware
    prefix = ids(12 * BLOCK, 5)
    # The CTX that prefix routing alone would pick (same first bytes, same server)...
    natural = rendezvous([Server(ctx1.url), Server(ctx2.url)],
                         relay.prefix_key({"prompt": prefix}))
    holder = ctx2 if natural.url == ctx1.url else ctx1
    other = ctx1 if holder is ctx2 else ctx2
    seed(holder, orch, prefix)          # ...and the one that holds the prefix
    before = [counts(w, gen, orch)["ctx_requests"] for w in (holder, other)]
    for i in range(3):
        body = completion(prefix + ids(7, 10 + i))
        assert direct(orch.url, "/v1/completions", body) == direct(
            gen.url, "/v1/completions", body)
    after = [counts(w, gen, orch)["ctx_requests"] for w in (holder, other)]
    assert (after[0] - before[0], after[1] - before[1]) == (3, 0)
