"""Prefix-cache isolation on real processes (tiny model): what `cached_tokens` tells a client
about other clients' prompts, with `cache_salt` and with --cache-isolation api_key, on a
worker's own port and through the orchestrator (CTX -> GEN, KV-aware CTX routing)."""

import base64

import numpy as np
import pytest

from server_utils import (TEST_SECRET, Orchestrator, Worker, call, internal, metrics, post,
                          wait_for)
from splitserve.orchestrator import relay
from splitserve.orchestrator.cluster import Server
from splitserve.orchestrator.routers import rendezvous
from splitserve.protocol.block_hashes import chain_hashes, salted_root
from splitserve.protocol.cache_salt import CacheIsolation

MODEL = ("--model", "tiny-random", "--dtype", "float32")
K1, K2 = "sk-tenant-one", "sk-tenant-two"
BLOCK = 16


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 40000, n).tolist()


def completion(prompt, salt=None, **extra) -> dict:
    body = {"model": "tiny-random", "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, **extra}
    return body if salt is None else {**body, "cache_salt": salt}


def cached(url: str, body: dict, headers: dict, path: str = "/v1/completions") -> int:
    status, answer = post(url + path, body, headers=headers)
    assert status == 200, answer
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def workers():
    """ctx1: two keys given as two flags, no isolation; gen: the same keys from the
    environment, isolated by key; ctx2: open."""
    ctx1 = Worker(*MODEL, "--role", "ctx", "--api-key", K1, "--api-key", K2)
    procs = [ctx1]
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SPLITSERVE_API_KEY", f"{K1},{K2}")
            procs.append(Worker(*MODEL, "--role", "gen", "--cache-isolation", "api_key"))
        procs.append(Worker(*MODEL, "--role", "ctx"))
        yield procs
    finally:
        for p in procs:
            p.close()


@pytest.fixture(scope="module")
def cluster(workers, tmp_path_factory):
    ctx1, gen, ctx2 = workers
    orch = Orchestrator(tmp_path_factory.mktemp("salt"), [ctx1.url, ctx2.url], [gen.url],
                        ctx_router="kv_aware", model="tiny-random", api_key=[K1, K2],
                        cache_isolation="api_key")
    yield ctx1, ctx2, gen, orch
    orch.close()


def test_cached_tokens_are_shared_only_within_a_salt(workers):
    ctx1 = workers[0]
    prompt = ids(4 * BLOCK + 5, 1)
    assert cached(ctx1.url, completion(prompt, "salt-a"), auth(K1)) == 0
    assert cached(ctx1.url, completion(prompt, "salt-b"), auth(K1)) == 0
    assert cached(ctx1.url, completion(prompt), auth(K1)) == 0
    # without isolation the salt alone decides: another key with the same salt shares
    assert cached(ctx1.url, completion(prompt, "salt-a"), auth(K2)) == 4 * BLOCK
    assert cached(ctx1.url, completion(prompt), auth(K2)) == 4 * BLOCK


def test_isolated_by_key_tenants_never_share(workers):
    gen = workers[1]
    prompt = ids(4 * BLOCK + 5, 2)
    assert cached(gen.url, completion(prompt), auth(K1)) == 0
    assert cached(gen.url, completion(prompt), auth(K2)) == 0      # the same prompt, unseen
    assert cached(gen.url, completion(prompt), auth(K1)) == 4 * BLOCK
    # a client's own salt narrows its key's: it never reaches another key's blocks
    assert cached(gen.url, completion(prompt, "s"), auth(K1)) == 0
    assert cached(gen.url, completion(prompt, "s"), auth(K2)) == 0
    assert cached(gen.url, completion(prompt, "s"), auth(K1)) == 4 * BLOCK
    # nor the unsalted cache: an internal request (its salt taken as sent) finds nothing
    assert cached(gen.url, completion(prompt), internal(gen.url)) == 0
    chat = {"model": "tiny-random", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "lighthouse " * 40}]}
    path = "/v1/chat/completions"
    assert cached(gen.url, chat, auth(K2), path) == 0
    assert cached(gen.url, chat, auth(K1), path) == 0
    assert cached(gen.url, chat, auth(K2), path) > 0


@pytest.mark.parametrize("salt", ["", 7, ["x"], "y" * 1025])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_salt_is_a_400_naming_it(cluster, salt, path):
    ctx1, _, gen, orch = cluster
    body = {"model": "tiny-random", "max_tokens": 2, "cache_salt": salt,
            **({"prompt": "hi"} if path == "/v1/completions" else
               {"messages": [{"role": "user", "content": "hi"}]})}
    for url, headers in ((ctx1.url, auth(K1)), (gen.url, auth(K2)), (orch.url, auth(K1))):
        status, answer = post(url + path, body, headers=headers)
        assert status == 400 and answer["error"]["param"] == "cache_salt", (url, answer)
        assert "y" * 64 not in answer["error"]["message"]
        good = {k: v for k, v in body.items() if k != "cache_salt"}
        assert post(url + path, good, headers=headers)[0] == 200


def gen_reused(gen) -> float:
    return metrics(gen.url).get("splitserve_kv_reused_blocks_total", 0.0)


def test_through_the_cluster_tenants_never_share(cluster):
    """The orchestrator derives each key's salt and relays it: CTX, GEN (its digest check of
    relayed tokens, its own prefix cache) and its KV-aware routing all hash with it."""
    _, _, gen, orch = cluster
    prompt = ids(8 * BLOCK + 3, 3)
    before = gen_reused(gen)
    assert cached(orch.url, completion(prompt, token_relay="metadata"), auth(K2)) == 0
    # K1's first request: nothing of K2's is reused anywhere
    assert cached(orch.url, completion(prompt, token_relay="metadata"), auth(K1)) == 0
    assert gen_reused(gen) == before
    # K1 again, tokens relayed: the GEN's digest check passes with the salt, and the hashes
    # it computes from the tokens are the ones the CTX computed (its pulled blocks hit)
    assert cached(orch.url, completion(prompt, token_relay="list"), auth(K1)) == 8 * BLOCK
    assert gen_reused(gen) == before + 8


def ctx_requests(url: str) -> float:
    return sum(v for k, v in metrics(url).items()
               if k.startswith("splitserve_requests_total{") and "/v1/" in k)


def holds(url: str, prompt: list[int], root: bytes) -> int | None:
    """How many hashes the worker reports, once they include every full block of prompt."""
    body = call("GET", url + "/internal/kv_blocks", headers=internal(url))[1]
    raw = base64.b64decode(body["hashes"])
    held = {raw[i:i + 16] for i in range(0, len(raw), 16)}
    whole = set(chain_hashes(root, np.array(prompt, dtype=np.int32), BLOCK)) <= held
    return len(held) if whole else None


def test_kv_aware_routing_finds_a_tenants_salted_prefix(cluster):
    ctx1, ctx2, gen, orch = cluster
    prefix = ids(12 * BLOCK, 5)
    natural = rendezvous([Server(ctx1.url), Server(ctx2.url)],
                         relay.prefix_key({"prompt": prefix}))
    holder, other = (ctx2, ctx1) if natural.url == ctx1.url else (ctx1, ctx2)
    # The holder prefills the prefix under K1's salt, as the orchestrator derives it
    salt = CacheIsolation("api_key", TEST_SECRET.encode()).salt(None, K1)
    assert post(holder.url + "/v1/completions", completion(prefix, salt))[0] == 200
    wait_for(lambda: holds(holder.url, prefix, salted_root(salt)) is not None, 10, "reported")
    n = holds(holder.url, prefix, salted_root(salt))
    key = f'splitserve_orchestrator_kv_index_blocks{{server="{holder.url}"}}'
    wait_for(lambda: metrics(orch.url).get(key) == n, 10, "the orchestrator reads it")
    before = {w.url: ctx_requests(w.url) for w in (holder, other)}
    for i in range(3):
        assert post(orch.url + "/v1/completions", completion(prefix + ids(7, 10 + i)),
                    headers=auth(K1))[0] == 200
    assert {w.url: ctx_requests(w.url) - before[w.url] for w in (holder, other)} == {
        holder.url: 3, other.url: 0}
    # K2's hashes of the same prompt are not the holder's: routed by prefix alone
    cached(orch.url, completion(prefix + ids(7, 20)), auth(K2))
    assert ctx_requests(other.url) - before[other.url] == 1
