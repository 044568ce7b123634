"""Token relay modes end to end: list, b64, metadata and auto give the same output, greedy
and seeded (the CTX samples the first token, the GEN the rest)."""

import asyncio
import base64

import numpy as np
import pytest

from server_utils import TEST_SECRET, Orchestrator, Worker, metrics, post, stream
from splitserve.tokens import PromptTokens
from splitserve.trust import INTERNAL_HEADER, Keys

MODEL = ("--model", "tiny-random", "--dtype", "float32")
COMPLETION = {"model": "tiny-random", "prompt": "A long time ago in a galaxy far away",
              "max_tokens": 10, "temperature": 0}
CHAT = {"model": "tiny-random", "messages": [{"role": "user", "content": "Hello there!"}],
        "max_tokens": 10, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ctx = Worker(*MODEL, "--role", "ctx")
    gen = Worker(*MODEL, "--role", "gen")
    orch = Orchestrator(tmp_path_factory.mktemp("relay"), [ctx.url], [gen.url])
    yield ctx, gen, orch
    for p in (orch, gen, ctx):
        p.close()


def text_of(answer) -> str:
    c = answer["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


SEEDED = {"temperature": 1.0, "top_p": 0.9, "seed": 42}


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("mode", ["list", "b64", "metadata", "auto"])
@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION),
                                        ("/v1/chat/completions", CHAT)])
def test_every_mode_gives_the_aggregated_output(cluster, mode, path, body, sampling):
    ctx, gen, orch = cluster
    body = {**body, **(SEEDED if sampling == "seeded" else {})}
    _, want = post(gen.url + path, body)
    status, got = post(orch.url + path, {**body, "token_relay": mode})
    assert status == 200 and text_of(got) == text_of(want)
    for k in ("prompt_tokens", "completion_tokens"):
        assert got["usage"][k] == want["usage"][k]
    events = stream(orch.url + path, {**body, "token_relay": mode})
    pieces = [c.get("text") or (c.get("delta") or {}).get("content") or ""
              for e in events[:-1] for c in e["choices"]]
    assert "".join(pieces) == text_of(want)


def test_auto_relays_length_only_when_prompt_values_are_read(cluster):
    """Penalties and echo read the prompt on GEN: its ids come with the KV, not over HTTP."""
    _, gen, orch = cluster
    key = 'splitserve_token_relay_total{mode="metadata"}'
    for extra in ({"repetition_penalty": 1.3}, {"echo": True}, {}):
        body = {**COMPLETION, **extra}
        before = metrics(gen.url)
        _, want = post(gen.url + "/v1/completions", body)
        status, got = post(orch.url + "/v1/completions", body)
        assert status == 200 and text_of(got) == text_of(want)
        assert metrics(gen.url)[key] == before.get(key, 0) + 1


def ctx_answer(ctx, relay):
    status, ans = post(ctx.url + "/v1/completions", {
        **COMPLETION, "disaggregated_params": {"request_type": "context_only", "token_relay": relay}})
    assert status == 200
    return ans["disaggregated_params"]


def gen_request(gen, params, **extra):
    return post(gen.url + "/v1/completions", {**COMPLETION, **extra, "disaggregated_params": {
        **params, "request_type": "generation_only"}})


def test_bad_relayed_tokens_get_400_and_leak_nothing(cluster):
    ctx, gen, _ = cluster
    dp = ctx_answer(ctx, "b64")
    n = dp["prompt_len"]
    raw = base64.b64decode(dp["prompt_token_ids_b64"])
    cases = [
        ({**dp, "prompt_token_ids_b64": "%%% not base64 %%%"}, "prompt_token_ids_b64"),
        ({**dp, "prompt_token_ids_b64": base64.b64encode(raw[:-2]).decode()}, "prompt_token_ids"),
        ({**dp, "prompt_token_ids_b64": base64.b64encode(raw[:-4]).decode()},
         "disaggregated_params.prompt_len"),
        ({**dp, "prompt_len": -5}, "disaggregated_params.prompt_len"),
    ]
    for bad, param in cases:
        status, err = gen_request(gen, bad)
        assert status == 400, err
        assert param in (err["error"]["param"] or ""), err
    meta = ctx_answer(ctx, "metadata")
    assert "prompt_token_ids" not in meta and "prompt_token_ids_b64" not in meta
    status, err = gen_request(gen, meta, prompt_logprobs=1)
    assert status == 400 and err["error"]["param"] == "prompt_logprobs"
    status, ok = gen_request(gen, meta)
    assert status == 200 and ok["usage"]["prompt_tokens"] == n
    assert metrics(gen.url)["splitserve_kv_blocks_used"] == 0


def test_b64_path_builds_no_python_list_of_the_prompt(cluster, monkeypatch, tiny_source):
    """A generation front-end in this process (its engine a real child process): building a
    list of the prompt anywhere on the b64 path fails the request."""
    import aiohttp
    from splitserve.config import EngineConfig, KVTransferConfig
    from splitserve.server.app import WorkerServer
    from splitserve.server.config import ServerConfig

    ctx, gen, _ = cluster
    dp = ctx_answer(ctx, "b64")
    _, want = post(gen.url + "/v1/completions", COMPLETION)

    def forbidden(*args, **kwargs):
        raise AssertionError("a Python list of the prompt was built")

    async def run():
        server = WorkerServer(ServerConfig(
            role="gen", port=0, internal_secret=TEST_SECRET, engine=EngineConfig(
                model="tiny-random", dtype="float32", num_threads=1,
                kv=KVTransferConfig(secret=TEST_SECRET))))
        await server.start()
        monkeypatch.setattr(PromptTokens, "tolist", forbidden)
        monkeypatch.setattr(PromptTokens, "from_list", forbidden)
        try:
            # in-process: its instance id is known without a challenge
            token = Keys(TEST_SECRET).token(server.config.instance_id)
            async with aiohttp.ClientSession(headers={INTERNAL_HEADER: token}) as client:
                url = f"http://127.0.0.1:{server.http.port}/v1/completions"
                async with client.post(url, json={**COMPLETION, "disaggregated_params": {
                        **dp, "request_type": "generation_only"}}) as r:
                    return r.status, await r.json()
        finally:
            await server.stop()

    status, body = asyncio.run(run())
    assert status == 200, body
    assert text_of(body) == text_of(want)


def test_context_worker_encodes_b64_from_the_array(monkeypatch):
    from splitserve.server.admission import relay_fields as _relay_fields
    prompt = PromptTokens(np.arange(100, dtype=np.int32))
    monkeypatch.setattr(PromptTokens, "tolist", lambda self: (_ for _ in ()).throw(AssertionError))
    fields = _relay_fields("b64", prompt)
    assert np.array_equal(np.frombuffer(base64.b64decode(fields["prompt_token_ids_b64"]), "<i4"),
                          prompt.array)
    assert _relay_fields("metadata", prompt) == {}
