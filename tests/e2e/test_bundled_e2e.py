"""The bundled SmolLM2-135M-Instruct through real processes: a CTX and a GEN worker behind
the orchestrator, KV over TCP, float32 so greedy output is exact."""

import pytest

from server_utils import Orchestrator, post, start_workers

pytestmark = pytest.mark.bundled

MODEL = ("--dtype", "float32", "--kv-cache-gib", "0.25")
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ctx, gen = start_workers((*MODEL, "--role", "ctx"), (*MODEL, "--role", "gen"))
    orch = Orchestrator(tmp_path_factory.mktemp("bundled"), [ctx.url], [gen.url])
    yield ctx, gen, orch
    for p in (orch, gen, ctx):
        p.close()


def test_capital_of_france_through_the_cluster(cluster):
    openai = pytest.importorskip("openai")
    _, gen, orch = cluster
    client = openai.OpenAI(base_url=orch.url + "/v1", api_key="none", timeout=120, max_retries=0)
    for relay in ("b64", "metadata"):
        out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=FRANCE,
                                             max_tokens=32, temperature=0,
                                             extra_body={"token_relay": relay})
        assert out.choices[0].message.content == "The capital of France is Paris."
        assert out.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=FRANCE,
                                            max_tokens=32, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."


def test_disaggregated_completion_equals_aggregated(cluster):
    _, gen, orch = cluster
    body = {"prompt": "The three primary colors are", "max_tokens": 24, "temperature": 0}
    _, want = post(gen.url + "/v1/completions", body)
    _, got = post(orch.url + "/v1/completions", body)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
