"""The orchestrator's trust boundary, over real processes: its own API key toward clients,
the internal secret toward its workers (which have a key of their own it never sees)."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from server_utils import Orchestrator, Worker, assert_unauthorized, call, get, post, stream
from splitserve.bench.server_process import free_port

KEY = "sk-cluster-test-key"
WORKER_KEY = "sk-worker-test-key"   # the workers' own: the orchestrator is not told it
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = ("--model", "tiny-random", "--dtype", "float32", "--api-key", WORKER_KEY)
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ctx = Worker(*MODEL, "--role", "ctx")
    gen = Worker(*MODEL, "--role", "gen")
    orchs = []
    try:
        tmp = tmp_path_factory.mktemp("trust")
        orchs.append(Orchestrator(tmp, [ctx.url], [gen.url], api_key=KEY))
        # it cannot verify its workers (they prove the cluster's secret, not its own)
        orchs.append(Orchestrator(tmp, [ctx.url], [gen.url], internal_secret="not-the-secret",
                                  max_retries=1, healthy=False))
        yield ctx, gen, *orchs
    finally:
        for p in (*orchs, gen, ctx):
            p.close()


def test_the_orchestrator_needs_its_api_key(cluster):
    orch = cluster[2]
    for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/chat/completions", CHAT),
                               ("POST", "/v1/completions", {"prompt": "hi"})):
        assert_unauthorized(*call(method, orch.url + path, body, {}), "You didn't provide an API key")
        assert_unauthorized(*call(method, orch.url + path, body, {"Authorization": "Bearer no"}),
                   "Incorrect")
        # the workers' key is not the orchestrator's
        assert_unauthorized(*call(method, orch.url + path, body,
                         {"Authorization": f"Bearer {WORKER_KEY}"}), "Incorrect")
    assert get(orch.url + "/health")[0] == 200
    assert get(orch.url + "/metrics")[0] == 200


def test_with_the_key_the_cluster_serves(cluster):
    ctx, gen, orch, _ = cluster
    status, answer, _ = call("POST", orch.url + "/v1/chat/completions", CHAT, AUTH)
    assert status == 200 and answer["usage"]["completion_tokens"] == 4, answer
    events = stream(orch.url + "/v1/chat/completions", CHAT, headers=AUTH)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    status, models, _ = call("GET", orch.url + "/v1/models", None, AUTH)
    assert status == 200 and models["data"][0]["id"], models
    # a client that goes around the orchestrator needs the workers' key
    assert call("POST", gen.url + "/v1/chat/completions", CHAT, AUTH)[0] == 401


def test_client_disaggregated_params_are_still_refused(cluster):
    orch = cluster[2]
    status, answer = post(orch.url + "/v1/chat/completions", {
        **CHAT, "disaggregated_params": {"request_type": "context_only"}}, headers=AUTH)
    assert status == 400 and answer["error"]["param"] == "disaggregated_params", answer


def test_a_wrong_secret_fails_requests_without_telling_clients_the_insides(cluster):
    ctx, gen, _, wrong = cluster
    status, health = get(wrong.url + "/health")
    assert status == 503 and json.loads(health)["healthy"] == {"ctx": [], "gen": []}, health
    status, answer = post(wrong.url + "/v1/chat/completions", CHAT, headers={})
    assert status == 503, answer
    message = answer["error"]["message"]
    assert "disaggregated_params" not in message and "secret" not in message
    assert "127.0.0.1" not in message and "http" not in message
    assert call("GET", wrong.url + "/v1/models")[0] == 503   # not the workers' 401


def test_the_orchestrator_will_not_start_without_a_secret(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"port": free_port(), "context_servers": ["http://127.0.0.1:1"],
                                    "generation_servers": ["http://127.0.0.1:2"]}))
    env = {k: v for k, v in os.environ.items() if k != "SPLITSERVE_INTERNAL_SECRET"}
    done = subprocess.run([sys.executable, "-m", "splitserve.cli", "orchestrator", "-c", str(path)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    for name in ("--internal-secret", "SPLITSERVE_INTERNAL_SECRET", "internal_secret"):
        assert name in done.stderr


def test_a_keyless_body_is_refused_on_its_head_and_never_held(cluster):
    """As on a worker (test_trust_worker.py): 401 before the body is read or `100 Continue`
    sent, and 64 MiB bodies leave the orchestrator's memory where it was (a few hundred kB
    move either way between two readings anyway); the same for /internal/ without the
    secret (403)."""
    from server_utils import send_unasked_body, unasked_bodies_held_kb
    orch, size = cluster[2], 64 << 20
    assert send_unasked_body(orch.url, "/v1/completions", size, expect=True)[0] == \
        b"HTTP/1.1 401 Unauthorized"
    assert send_unasked_body(orch.url, "/internal/workers", size, expect=True)[0] == \
        b"HTTP/1.1 403 Forbidden"
    paths = ["/internal/workers", "/v1/chat/completions", "/v1/completions"] * 4
    lines, one, twelve = unasked_bodies_held_kb(orch.url, orch.proc.pid, paths)
    assert lines == {b"HTTP/1.1 401 Unauthorized", b"HTTP/1.1 403 Forbidden"}
    assert one < 1024 and twelve < 12 * 1024, (one, twelve)
    assert call("POST", orch.url + "/v1/chat/completions", CHAT, AUTH)[0] == 200
