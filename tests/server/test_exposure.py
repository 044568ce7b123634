"""A server that listens beyond loopback without an API key says so at start: one WARNING
line naming the address (serve, orchestrator and up, from the configs their commands build);
`up --host` exposes the orchestrator only (tests/e2e/test_trust_up.py checks its sockets)."""

import logging

import pytest

from splitserve.cli import build_parser, orchestrator_config, server_config
from splitserve.listen import is_loopback, local_url
from splitserve.orchestrator.up import cluster_config

SECRET = {"SPLITSERVE_INTERNAL_SECRET": "s"}


def serve(host: str, key: str | None, tmp_path) -> None:
    server_config(build_parser().parse_args(
        ["serve", "--model", "tiny-random", "--host", host, *(["--api-key", key] if key else [])]))


def orchestrator(host: str, key: str | None, tmp_path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("internal_secret: s\ncontext_servers: {urls: []}\n"
                    "generation_servers: {urls: []}\n")
    orchestrator_config(build_parser().parse_args(
        ["orchestrator", "-c", str(path), "--host", host, *(["--api-key", key] if key else [])]))


def up(host: str, key: str | None, tmp_path) -> None:
    cluster_config(build_parser().parse_args(
        ["up", "--host", host, *(["--api-key", key] if key else [])]), SECRET)


@pytest.mark.parametrize("command", [serve, orchestrator, up])
@pytest.mark.parametrize("host, key, warned", [
    ("0.0.0.0", None, True), ("::", None, True), ("0.0.0.0", "sk-key", False),
    ("127.0.0.1", None, False), ("localhost", None, False), ("::1", None, False),
])
def test_a_keyless_server_beyond_loopback_warns_once(command, host, key, warned, tmp_path,
                                                      monkeypatch, caplog):
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    with caplog.at_level(logging.WARNING):
        command(host, key, tmp_path)
    lines = [r.getMessage() for r in caplog.records if "without an API key" in r.getMessage()]
    if not warned:
        assert lines == []
        return
    (line,) = lines
    assert f"listening on {host} without an API key" in line and "no key needed" in line
    assert [r.levelno for r in caplog.records if r.getMessage() == line] == [logging.WARNING]


def test_loopback_and_local_urls():
    assert is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("10.0.0.1")
    assert not is_loopback("no-such-host.invalid")
    assert local_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert local_url("::", 8000) == "http://[::1]:8000"
    assert local_url("10.0.0.1", 8000) == "http://10.0.0.1:8000"


def test_up_takes_a_worker_host():
    assert build_parser().parse_args(["up"]).worker_host == "127.0.0.1"
    assert build_parser().parse_args(["up", "--worker-host", "0.0.0.0"]).worker_host == "0.0.0.0"
