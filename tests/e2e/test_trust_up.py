"""`splitserve up --api-key K --host 0.0.0.0`: the official openai client with K is served,
without it or with another key it is refused; the internal secret `up` generates reaches
every child through its environment, never a command line; only the orchestrator listens
beyond loopback."""

import ipaddress
import os

import openai
import pytest

from server_utils import UpCluster, assert_unauthorized, call, descendants

KEY = "sk-up-test-key"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    log = tmp_path_factory.mktemp("up") / "up.log"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SPLITSERVE_INTERNAL_SECRET")     # so that `up` makes one
        mp.delenv("SPLITSERVE_API_KEY", raising=False)
        cluster = UpCluster("--model", "tiny-random", "--dtype", "float32", "--api-key", KEY,
                            "--host", "0.0.0.0", log=log)
    cluster.log = log
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


def listening_addresses(pid: int) -> dict[int, str]:
    """{port: address} of the TCP sockets process `pid` listens on (/proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = {}
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:    # LISTEN
                    address, port = fields[1].split(":")
                    out[int(port, 16)] = _address(bytes.fromhex(address))
    return out


def _address(raw: bytes) -> str:
    """/proc/net/tcp* print an address as 32-bit words in host (little-endian) order."""
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def test_up_host_exposes_the_orchestrator_only(up):
    assert listening_addresses(up.proc.pid) == {up.port: "0.0.0.0"}
    workers = {port: address for pid in descendants(up.proc.pid)
               for port, address in listening_addresses(pid).items()}
    assert {up.port + 1, up.port + 2} <= set(workers)    # their HTTP ports (and KV servers)
    assert set(workers.values()) == {"127.0.0.1"}, workers
    with open(up.log) as f:    # an API key: no warning about one
        assert "without an API key" not in f.read()
