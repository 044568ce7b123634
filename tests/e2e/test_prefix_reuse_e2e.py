"""Prefix reuse and prompt tokens over the KV pull with real processes: orchestrator -> CTX
-> GEN on loopback (tiny model, float32 so greedy output is exact). What moved is read from
the GEN's /metrics."""

import numpy as np
import pytest

from server_utils import Orchestrator, Worker, metrics, post, stream

MODEL = ("--model", "tiny-random", "--dtype", "float32")
rng = np.random.default_rng(7)
SHARED = rng.integers(3, 49152, 1024).tolist()     # 64 blocks of 16
BODY = {"model": "tiny-random", "max_tokens": 8, "temperature": 0}
KEYS = ("splitserve_kv_pulled_blocks_total", "splitserve_kv_reused_blocks_total",
        "splitserve_kv_pulled_bytes_total")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ctx = Worker(*MODEL, "--role", "ctx")
    gen = Worker(*MODEL, "--role", "gen")
    orch = Orchestrator(tmp_path_factory.mktemp("prefix"), [ctx.url], [gen.url])
    yield ctx, gen, orch
    for p in (orch, gen, ctx):
        p.close()


def moved(gen, send) -> tuple[dict, list[float]]:
    """send()'s answer and what the GEN pulled and reused for it (blocks, blocks, bytes)."""
    before = metrics(gen.url)
    answer = send()
    after = metrics(gen.url)
    return answer, [after[k] - before.get(k, 0) for k in KEYS]


def complete(orch, prompt, relay, **extra):
    status, answer = post(orch.url + "/v1/completions",
                          {**BODY, **extra, "prompt": prompt, "token_relay": relay})
    assert status == 200, answer
    return answer


def test_a_shared_prefix_sent_twice_moves_only_the_new_blocks(cluster):
    ctx, gen, orch = cluster
    first = SHARED + rng.integers(3, 49152, 5).tolist()      # 1029 tokens: 65 blocks
    second = SHARED + rng.integers(3, 49152, 64).tolist()    # 1088 tokens: 68 blocks
    _, (blocks, reused, nbytes) = moved(gen, lambda: complete(orch, first, "metadata"))
    assert (blocks, reused) == (65, 0)
    block_bytes = nbytes / blocks
    got, (blocks, reused, nbytes) = moved(gen, lambda: complete(orch, second, "metadata"))
    assert (blocks, reused, nbytes) == (4, 64, 4 * block_bytes)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 1024
    want = complete(orch, second, "list")
    assert got["choices"][0]["text"] == want["choices"][0]["text"]


@pytest.mark.parametrize("extra", [{"repetition_penalty": 1.3}, {"echo": True},
                                   {"echo": True, "stream": True}])
def test_prompt_readers_in_metadata_mode_equal_list_mode(cluster, extra):
    """Penalties and echo read the prompt on GEN: its ids come with the KV. The relayed
    body carried the length only (GEN counted a metadata relay)."""
    _, gen, orch = cluster
    prompt = "Once upon a time there was a lighthouse keeper who"

    def text(relay):
        body = {**BODY, **extra, "prompt": prompt, "token_relay": relay}
        if extra.get("stream"):
            events = stream(orch.url + "/v1/completions", body)
            return "".join(c["text"] for e in events[:-1] for c in e["choices"])
        return complete(orch, prompt, relay, **extra)["choices"][0]["text"]
    key = 'splitserve_token_relay_total{mode="metadata"}'
    before = metrics(gen.url).get(key, 0)
    got = text("metadata")
    assert metrics(gen.url)[key] == before + 1
    assert got == text("list")
    if extra.get("echo"):
        assert got.startswith(prompt)


def test_a_public_client_can_never_send_block_hashes(cluster):
    """Hashes are filed in GEN's prefix cache: only a peer with the internal secret may
    send a KV handle (docs/security.md)."""
    ctx, gen, orch = cluster
    status, answer = post(ctx.url + "/v1/completions", {
        **BODY, "prompt": SHARED, "disaggregated_params": {"request_type": "context_only",
                                                           "token_relay": "metadata"}})
    assert status == 200
    dp = {**answer["disaggregated_params"], "request_type": "generation_only"}
    assert dp["kv_handle"]["block_hashes"]                    # base64 of 64 x 16 bytes
    body = {**BODY, "prompt": SHARED, "disaggregated_params": dp}
    status, err = post(gen.url + "/v1/completions", body, headers={})
    assert status == 403 and err["error"]["param"] == "disaggregated_params"
    status, err = post(orch.url + "/v1/completions", body, headers={})
    assert status == 400 and err["error"]["param"] == "disaggregated_params"
    status, ok = post(gen.url + "/v1/completions", body)     # the cluster's own request
    assert status == 200, ok
