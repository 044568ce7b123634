"""The worker registration API of a real orchestrator process (no workers needed): only
internal requests may call it, bad bodies get 400 with an OpenAI error body naming the
field, and members leave when their lease lapses or their health checks keep failing."""

import time

import pytest
import yaml

from server_utils import TEST_SECRET, CLIENT, call, internal, wait_for
from splitserve.bench.server_process import ServerProcess, free_port
from splitserve.orchestrator.registry import MAX_MEMBERS, MAX_URL_CHARS
from splitserve.trust import INTERNAL_HEADER, Keys, new_instance_id

API = "/internal/workers"


def start_orchestrator(tmp_path, **config) -> ServerProcess:
    """An orchestrator with no static workers (its /health is 503 until one registers)."""
    port = free_port()
    path = tmp_path / f"cluster-{port}.yaml"
    path.write_text(yaml.safe_dump({
        "port": port, "health_check_interval": 0.5, "internal_secret": TEST_SECRET,
        "context_servers": {"urls": []}, "generation_servers": {"urls": []}, **config}))
    orch = ServerProcess(["orchestrator", "-c", str(path)], port)
    wait_for(lambda: answers(orch.url), 60, "orchestrator listening")
    return orch


def answers(url: str) -> bool:
    try:
        call("GET", url + "/health")
        return True
    except OSError:
        return False


def members(url: str) -> dict[str, str]:
    status, body, _ = call("GET", url + API, headers=internal(url))
    assert status == 200 and body["object"] == "list", body
    return {m["url"]: m["role"] for m in body["data"]}


@pytest.fixture(scope="module")
def orch(tmp_path_factory):
    o = start_orchestrator(tmp_path_factory.mktemp("registry"), remove_unhealthy_after=1.5)
    yield o
    o.close()


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"     # nothing listens there


# What a client without the token may try: the secret itself (in the header that carried it,
# in the one tokens ride, as a Bearer key), a wrong token, and the token of another instance (a worker
# or an orchestrator that is gone: what a process squatting its port may have collected).
FORGERIES = {
    "none": lambda url: {},
    "the secret, old header": lambda url: {"X-Splitserve-Internal-Secret": TEST_SECRET},
    "the secret": lambda url: {INTERNAL_HEADER: TEST_SECRET},
    "the secret as a key": lambda url: {"Authorization": f"Bearer {TEST_SECRET}"},
    "a wrong token": lambda url: {INTERNAL_HEADER: "0" * 64},
    "another instance's token": lambda url: {
        INTERNAL_HEADER: Keys(TEST_SECRET).token(new_instance_id())},
    "this instance's token from another secret": lambda url: {
        INTERNAL_HEADER: Keys("another").token(CLIENT.learn(url))},
}


@pytest.mark.parametrize("method,path", [("GET", API), ("POST", API), ("DELETE", API),
                                         ("POST", API + "/remove")])
@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_a_client_without_the_token_gets_403(orch, method, path, forgery):
    url = dead_url()
    body = {"role": "generation", "url": url} if method != "GET" else None
    status, answer, _ = call(method, orch.url + path, body, headers=FORGERIES[forgery](orch.url))
    assert status == 403, answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert url not in members(orch.url)


@pytest.mark.parametrize("body,param", [
    ({"role": "decoder", "url": "http://127.0.0.1:1"}, "role"),
    ({"role": "generation", "url": "http://127.0.0.1:1", "ttl": 0}, "ttl"),
    ({"role": "generation", "url": "http://127.0.0.1:1", "ttl": 3601}, "ttl"),
    ({"role": "generation", "url": "http://h:1/" + "x" * MAX_URL_CHARS}, "url"),
    ({"role": "generation", "url": "ftp://127.0.0.1:1"}, "url"),
    ({"role": "generation", "url": "http://127.0.0.1:1/v1?x=1"}, "url"),
    ({"role": "generation", "url": "http://127.0.0.1:99999"}, "url"),
    ({"role": "generation", "url": 7}, "url"),
    ({"role": "generation"}, "url"),
    ({"role": "generation", "url": "http://127.0.0.1:1", "weight": 2}, "weight"),
    (["generation", "http://127.0.0.1:1"], None),
])
def test_a_bad_registration_is_a_400_naming_the_field(orch, body, param):
    status, answer, _ = call("POST", orch.url + API, body, headers=internal(orch.url))
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert members(orch.url) == {}


def test_a_body_that_is_not_json_is_a_400(orch):
    import urllib.request
    req = urllib.request.Request(orch.url + API, b"{nope", method="POST", headers=internal(orch.url))
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=10)
    assert exc.value.code == 400
    assert b"not valid JSON" in exc.value.read()


def test_register_list_and_leave_both_ways(orch):
    a, b = dead_url(), dead_url()
    for url, role in ((a, "context"), (b, "generation")):
        status, answer, _ = call("POST", orch.url + API, {"role": role, "url": url + "/",
                                                          "ttl": 60}, headers=internal(orch.url))
        assert status == 200 and url in {m["url"] for m in answer["data"]}
    assert members(orch.url) == {a: "context", b: "generation"}
    assert call("DELETE", orch.url + API, {"url": a}, headers=internal(orch.url))[0] == 200
    assert call("POST", orch.url + API + "/remove", {"url": b}, headers=internal(orch.url))[0] == 200
    assert members(orch.url) == {}


def test_a_worker_failing_its_health_checks_leaves(orch):
    url = dead_url()
    call("POST", orch.url + API, {"role": "generation", "url": url, "ttl": 600}, headers=internal(orch.url))
    assert url in members(orch.url)
    t = time.monotonic()
    wait_for(lambda: url not in members(orch.url), 15, "the unhealthy worker gone")
    assert time.monotonic() - t >= 1.0       # remove_unhealthy_after: 1.5 s


def test_a_lapsed_lease_leaves(tmp_path):
    orch = start_orchestrator(tmp_path, remove_unhealthy_after=600)
    try:
        url = dead_url()
        call("POST", orch.url + API, {"role": "context", "url": url, "ttl": 1}, headers=internal(orch.url))
        assert url in members(orch.url)
        wait_for(lambda: url not in members(orch.url), 10, "the lease lapsed")
    finally:
        orch.close()


def test_members_are_bounded(tmp_path):
    # Its own orchestrator, which keeps dead members; and members on 127.0.0.3, where
    # dead_url() (127.0.0.1, a port from free_port's range) cannot name one of them: the
    # 257th would then renew a lease instead of being refused.
    orch = start_orchestrator(tmp_path, remove_unhealthy_after=600)
    urls = [f"http://127.0.0.3:{20000 + i}" for i in range(MAX_MEMBERS)]
    try:
        for url in urls:
            assert call("POST", orch.url + API, {"role": "generation", "url": url, "ttl": 600},
                        headers=internal(orch.url))[0] == 200
        status, answer, _ = call("POST", orch.url + API, {"role": "generation",
                                 "url": dead_url()}, headers=internal(orch.url))
        assert status == 400 and "limit of 256" in answer["error"]["message"], answer
        # a member renews its lease at the limit
        assert call("POST", orch.url + API, {"role": "generation", "url": urls[0]},
                    headers=internal(orch.url))[0] == 200
    finally:
        orch.close()
