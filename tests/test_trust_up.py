"""`splitserve up --api-key K`: the official openai client with K is served, without it or
with another key it is refused; the internal secret `up` generates reaches every child
through its environment, never a command line."""

import openai
import pytest

from server_utils import UpCluster, assert_unauthorized, call, descendants

KEY = "sk-up-test-key"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def up():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SPLITSERVE_INTERNAL_SECRET")     # so that `up` makes one
        mp.delenv("SPLITSERVE_API_KEY", raising=False)
        cluster = UpCluster("--model", "tiny-random", "--dtype", "float32", "--api-key", KEY)
    try:
        yield cluster
    finally:
        cluster.interrupt()
        cluster.close()


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def read(pid: int, what: str) -> bytes:
    with open(f"/proc/{pid}/{what}", "rb") as f:
        return f.read()


def test_the_openai_client_with_the_key_is_served(up):
    model = client(up.url, KEY).models.list().data[0].id
    answer = client(up.url, KEY).chat.completions.create(
        model=model, messages=CHAT, max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 4 and answer.choices[0].message.content
    chunks = list(client(up.url, KEY).chat.completions.create(
        model=model, messages=CHAT, max_tokens=4, temperature=0, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_without_the_key_the_openai_client_is_refused(up, key):
    with pytest.raises(openai.AuthenticationError) as raised:
        # None: no Authorization header at all (the client insists on a key unless told so)
        client(up.url, key or "unused").chat.completions.create(
            model="tiny-random", messages=CHAT, max_tokens=4,
            extra_headers={"Authorization": openai.Omit()} if key is None else None)
    assert raised.value.status_code == 401 and raised.value.code == "invalid_api_key"
    assert ("didn't provide" if key is None else "Incorrect API key") in str(raised.value)


def test_the_secrets_reach_the_children_by_environment_only(up):
    children = descendants(up.proc.pid)
    secrets = set()
    for pid in children:
        env = dict(line.split(b"=", 1) for line in read(pid, "environ").split(b"\0") if b"=" in line)
        secrets.add(env.get(b"SPLITSERVE_INTERNAL_SECRET"))
        assert env.get(b"SPLITSERVE_API_KEY") == KEY.encode()
    (secret,) = secrets                               # one secret, in every child
    assert secret and len(secret) >= 43               # secrets.token_urlsafe(32)
    for pid in (up.proc.pid, *children):
        assert secret not in read(pid, "cmdline")
    for pid in children:
        assert KEY.encode() not in read(pid, "cmdline")


def test_a_client_that_goes_around_the_orchestrator_needs_the_key_too(up):
    worker = f"http://127.0.0.1:{up.port + 1}"
    assert_unauthorized(*call("GET", worker + "/v1/models"), "You didn't provide")
    assert call("GET", worker + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})[0] == 200
