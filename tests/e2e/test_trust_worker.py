"""A worker's trust boundary, over real sockets: the API key on its public routes, and
disaggregated_params only with the internal token for this worker's instance, derived from
the cluster's internal secret (no engine work, no KV dial for anything refused)."""

import json
import math
import select
import socket
import time
import urllib.request

import pytest

from server_utils import (CLIENT, TEST_SECRET, Worker, assert_unauthorized, call, get,
                          internal, metrics, post, stream)
from splitserve.trust import (CHALLENGE_HEADER, IDENTITY_HEADER, INTERNAL_HEADER, PROOF_HEADER,
                              Keys, new_challenge, new_instance_id)

KEY = "sk-worker-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = ("--model", "tiny-random", "--dtype", "float32")
PROMPT = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
# The token of another instance of this cluster (a worker that is gone): good nowhere else.
OTHER = {INTERNAL_HEADER: Keys(TEST_SECRET).token(new_instance_id())}
PUBLIC = [("GET", "/v1/models", None), ("POST", "/v1/completions", PROMPT),
          ("POST", "/v1/chat/completions", CHAT), ("POST", "/tokenize", {"prompt": "hi"}),
          ("POST", "/detokenize", {"tokens": [1, 2]}), ("GET", "/v1/nowhere", None)]


@pytest.fixture(scope="module")
def worker():
    """API key from the command line, internal secret from the environment (server_utils)."""
    w = Worker(*MODEL, "--api-key", KEY)
    yield w
    w.close()


@pytest.fixture(scope="module")
def no_secret_worker():
    """No internal secret and no API key anywhere: an open worker that takes no internal
    request."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SPLITSERVE_INTERNAL_SECRET")
        mp.delenv("SPLITSERVE_API_KEY", raising=False)
        w = Worker(*MODEL)
    yield w
    w.close()


@pytest.mark.parametrize("method,path,body", PUBLIC)
def test_public_routes_need_the_api_key(worker, method, path, body):
    url = worker.url + path
    assert_unauthorized(*call(method, url, body, {}), "You didn't provide an API key")
    assert_unauthorized(*call(method, url, body, {"Authorization": "Bearer sk-wrong"}), "Incorrect")
    assert_unauthorized(*call(method, url, body, {"Authorization": KEY}), "You didn't provide")
    assert_unauthorized(*call(method, url, body, {"Authorization": f"Basic {KEY}"}), "You didn't")
    assert_unauthorized(*call(method, url, body, {"Authorization": f"Bearer {KEY}x"}), "Incorrect")
    status, answer, _ = call(method, url, body, AUTH)
    assert status == (404 if path == "/v1/nowhere" else 200), answer


def test_the_internal_token_stands_in_for_the_key(worker):
    assert call("POST", worker.url + "/v1/completions", PROMPT, internal(worker.url))[0] == 200
    for wrong in ({INTERNAL_HEADER: TEST_SECRET}, OTHER):   # the secret itself is no token
        assert_unauthorized(*call("POST", worker.url + "/v1/completions", PROMPT, wrong),
                            "You didn't")


def challenged(url: str, nonce: str) -> tuple[int, str | None]:
    """GET /health with a challenge: (status, the identity header)."""
    req = urllib.request.Request(url + "/health", headers={CHALLENGE_HEADER: nonce})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, r.headers.get(IDENTITY_HEADER)


def test_health_proves_the_workers_identity_to_a_fresh_challenge(worker):
    keys, nonce = Keys(TEST_SECRET), new_challenge()
    status, answer = challenged(worker.url, nonce)
    instance = keys.verify(nonce, answer)
    assert status == 200 and instance is not None, answer
    assert keys.verify(new_challenge(), answer) is None        # bound to the nonce: no replay
    assert Keys("another secret").verify(nonce, answer) is None
    assert TEST_SECRET not in answer and keys.token(instance) not in answer
    again = new_challenge()
    assert keys.verify(again, challenged(worker.url, again)[1]) == instance   # one instance
    for bad in ("short", "x|" * 20, "é" * 20, "a" * 200):     # not a challenge: no answer
        assert challenged(worker.url, bad)[1] is None
    assert get(worker.url + "/health")[0] == 200               # still open to anyone


def test_only_an_answer_to_the_token_carries_the_response_proof(worker):
    keys = Keys(TEST_SECRET)
    proof = keys.proof(CLIENT.learn(worker.url))
    url = worker.url + "/v1/completions"
    assert call("POST", url, PROMPT, internal(worker.url))[2].get(PROOF_HEADER) == proof
    for headers in (AUTH, {**AUTH, **OTHER}, {**AUTH, INTERNAL_HEADER: TEST_SECRET}):
        status, _, answer_headers = call("POST", url, PROMPT, headers)
        assert status == 200 and PROOF_HEADER not in answer_headers
    req = urllib.request.Request(url, json.dumps({**PROMPT, "stream": True}).encode(),
                                 {"Content-Type": "application/json", **internal(worker.url)})
    with urllib.request.urlopen(req, timeout=60) as r:      # a stream's head carries it too
        assert r.headers.get(PROOF_HEADER) == proof and r.read().endswith(b"[DONE]\n\n")


def test_health_and_metrics_stay_open(worker):
    assert get(worker.url + "/health")[0] == 200
    status, text = get(worker.url + "/metrics")
    assert status == 200 and b"splitserve_requests_total" in text


def generated(url: str) -> float:
    m = metrics(url)
    return m["splitserve_generation_tokens_total"] + m["splitserve_prompt_tokens_total"]


def context_answer(worker) -> dict:
    status, answer = post(worker.url + "/v1/completions", {
        **PROMPT, "disaggregated_params": {"request_type": "context_only",
                                           "token_relay": "list"}}, headers={**AUTH, **internal(worker.url)})
    assert status == 200, answer
    return answer["disaggregated_params"]


def forged_bodies(dp: dict, endpoint: str) -> dict[str, tuple[str, dict]]:
    """Each internal field a public client might send: (path, body)."""
    forged = {**dp, "request_type": "generation_only",
              "kv_handle": {**dp["kv_handle"], "endpoint": endpoint}}
    return {
        "context_only": ("/v1/completions", {**PROMPT, "disaggregated_params": {
            "request_type": "context_only"}}),
        "generation_only": ("/v1/completions", {**PROMPT, "disaggregated_params": forged}),
        "resume_token_ids": ("/v1/chat/completions", {**CHAT, "stream": True,
                                                      "disaggregated_params": {
                                                          "resume_token_ids": [5, 6]}}),
        "stream_token_ids": ("/v1/chat/completions", {**CHAT, "stream": True,
                                                      "disaggregated_params": {
                                                          "stream_token_ids": True}}),
        "empty": ("/v1/completions", {**PROMPT, "disaggregated_params": {}}),
        "malformed": ("/v1/completions", {**PROMPT, "disaggregated_params": {"prompt_len": -1}}),
    }


def escaped(body: dict) -> bytes:
    """The same body with the field's name spelled with a JSON escape."""
    return json.dumps(body).replace('"disaggregated_params"',
                                    '"disaggregated\\u005fparams"').encode()


def nothing_connects(listener: socket.socket, seconds: float) -> bool:
    return not select.select([listener], [], [], seconds)[0]


def test_internal_fields_from_a_public_client_are_refused(worker):
    dp = context_answer(worker)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        before = generated(worker.url)
        for name, (path, body) in forged_bodies(dp, endpoint).items():
            for data in (body, escaped(body)):
                for headers in (AUTH, {**AUTH, INTERNAL_HEADER: "not-the-token"},
                                {**AUTH, INTERNAL_HEADER: TEST_SECRET}, {**AUTH, **OTHER}):
                    status, answer = post(worker.url + path, data, headers=headers)
                    assert status == 403, (name, answer)
                    error = answer["error"]
                    assert error["param"] == "disaggregated_params", answer
                    assert "does not carry the cluster's internal token" in error["message"]
        assert nothing_connects(listener, 3.0), "the worker dialled the forged KV endpoint"
        assert generated(worker.url) == before, "the engine worked on a refused request"
    status, answer = post(worker.url + "/v1/completions", PROMPT, headers=AUTH)
    assert status == 200 and answer["usage"]["completion_tokens"] == 4


def test_internal_fields_with_the_secret_are_served(worker):
    both = {**AUTH, **internal(worker.url)}
    dp = context_answer(worker)
    status, answer = post(worker.url + "/v1/completions", {
        **PROMPT, "disaggregated_params": {**dp, "request_type": "generation_only"}},
        headers=both)
    assert status == 200 and answer["usage"]["completion_tokens"] == 4, answer
    events = stream(worker.url + "/v1/chat/completions", {
        **CHAT, "disaggregated_params": {"resume_token_ids": [5, 6]}}, headers=both)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    # only the secret, no key: the orchestrator's hop
    events = stream(worker.url + "/v1/chat/completions", {
        **CHAT, "disaggregated_params": {"stream_token_ids": True}})
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])


def test_a_worker_without_a_secret_refuses_every_internal_request(no_secret_worker):
    url = no_secret_worker.url
    assert post(url + "/v1/completions", PROMPT, headers={})[0] == 200    # no key: open
    before = generated(url)
    for secret in (None, TEST_SECRET, ""):
        headers = {} if secret is None else {INTERNAL_HEADER: secret}
        for path, body in forged_bodies({"kv_handle": {}}, "tcp://127.0.0.1:1").values():
            status, answer = post(url + path, body, headers=headers)
            assert status == 403, answer
            assert "has no internal secret configured" in answer["error"]["message"]
    assert generated(url) == before


def e2e_seconds(url: str) -> float:
    """The e2e latency histogram's sum (arrival, or a believed X-Sent-At, to the last token)."""
    return next(v for k, v in metrics(url).items() if k.endswith("e2e_request_latency_seconds_sum"))


def test_only_an_internal_sender_sets_when_a_request_was_sent(worker):
    """X-Sent-At moves a request's arrival back (the orchestrator's send time): a public
    client's is ignored, and an internal one is believed only within the last hour."""
    now = time.time()
    before = e2e_seconds(worker.url)
    for sent in (repr(now - 1000), "nan", "inf", "-inf", "-1e300", "1e300", "x"):
        assert call("POST", worker.url + "/v1/completions", PROMPT,
                    {**AUTH, "X-Sent-At": sent})[0] == 200
    for sent in ("nan", "inf", repr(now + 1000), repr(now - 10_000)):
        assert call("POST", worker.url + "/v1/completions", PROMPT,
                    {**internal(worker.url), "X-Sent-At": sent})[0] == 200
    after = e2e_seconds(worker.url)
    assert math.isfinite(after) and after - before < 60, (before, after)
    assert call("POST", worker.url + "/v1/completions", PROMPT,
                {**internal(worker.url), "X-Sent-At": repr(time.time() - 100)})[0] == 200
    assert e2e_seconds(worker.url) - after >= 100


def test_a_keyless_body_is_refused_on_its_head_and_never_held(worker):
    """401 before a byte of the body is kept, or a `100 Continue` sent: 64 MiB bodies from
    a client without the key leave the front-end's memory where it was (a few hundred kB
    move either way between two readings anyway)."""
    from server_utils import send_unasked_body, unasked_bodies_held_kb
    first, _ = send_unasked_body(worker.url, "/v1/completions", 64 << 20, expect=True)
    assert first == b"HTTP/1.1 401 Unauthorized"
    lines, one, twelve = unasked_bodies_held_kb(worker.url, worker.proc.pid,
                                                ["/v1/completions", "/tokenize"] * 6)
    assert lines == {b"HTTP/1.1 401 Unauthorized"}
    assert one < 1024 and twelve < 12 * 1024, (one, twelve)
    assert call("POST", worker.url + "/v1/completions", PROMPT, AUTH)[0] == 200
