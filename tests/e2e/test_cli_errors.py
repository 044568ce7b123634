"""A flag, a cluster file or a model that cannot work ends the command with a line that
names it (a usage error, exit 2; or, for what fails while starting, exit 1), not a Python
traceback, and `up` starts no worker for a configuration it refuses."""

from __future__ import annotations

import subprocess
import sys

import pytest

from server_utils import free_port


def run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "splitserve.cli", *argv], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("argv, said", [
    (("serve", "--model", "tiny-random", "--max-model-len", "0"),
     "splitserve: error: serve: max_model_len must be >= 2"),
    (("serve", "--model", "tiny-random", "--kv-cache-gib", "-1"),
     "splitserve: error: serve: KV cache memory budget must be positive"),
    (("serve", "--model", "tiny-random", "--api-server-count", "0"),
     "splitserve: error: serve: api_server_count must be at least 1, got 0"),
    (("orchestrator", "-c", "/nonexistent/cluster.yaml"),
     "splitserve: error: orchestrator: [Errno 2] No such file or directory"),
])
def test_a_refused_value_is_a_usage_error(argv, said):
    done = run(*argv, "--port", str(free_port()))
    assert done.returncode == 2 and said in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("text, said", [
    ("port: [1\n", "expected ',' or ']'"),
    ("bogus: 1\ncontext_servers: {urls: []}\ngeneration_servers: {urls: []}\n",
     "unknown keys ['bogus']"),
    ("max_in_flight: 0\ncontext_servers: {urls: []}\ngeneration_servers: {urls: []}\n",
     "max_in_flight must be positive"),
])
def test_a_bad_cluster_file_is_a_usage_error(tmp_path, text, said):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    done = run("orchestrator", "-c", str(path), "--internal-secret", "s")
    assert done.returncode == 2 and said in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_up_refuses_its_configuration_before_starting_a_worker():
    done = run("--log-level", "INFO", "up", "--max-in-flight", "0", "--port", str(free_port()))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "up: max_in_flight must be positive, got 0" in done.stderr
    assert "ctx:" not in done.stderr and "gen:" not in done.stderr   # no worker said a word
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("argv, said", [
    (("--cache-isolation", "api_key"), "up: cache_isolation api_key needs API keys"),
    (("--api-key", "sk-a,b"), "up: an API key must not contain a comma"),
])
def test_up_refuses_keys_it_cannot_isolate_or_hand_on(monkeypatch, argv, said):
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    done = run("--log-level", "INFO", "up", *argv, "--port", str(free_port()))
    assert done.returncode == 2 and said in done.stderr, done.stderr[-2000:]
    assert "ctx:" not in done.stderr and "sk-a" not in done.stderr


def test_up_hands_its_keys_and_isolation_to_every_worker(monkeypatch):
    from splitserve.cli import build_parser
    from splitserve.orchestrator.up import cluster_secrets, worker_command
    from splitserve.placement import WorkerPlan
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    args = build_parser().parse_args(["up", "--api-key", "sk-1", "sk-2", "--cache-isolation",
                                      "api_key"])
    args.log_level = "INFO"
    assert cluster_secrets(args)["SPLITSERVE_API_KEY"] == "sk-1,sk-2"
    cmd = worker_command(args, "gen", 9001, WorkerPlan((1,), 1, (0,)))
    assert cmd[cmd.index("--cache-isolation") + 1] == "api_key" and "sk-1" not in cmd


def test_a_model_that_does_not_exist_ends_serve_with_its_name():
    done = run("serve", "--model", "/nonexistent/model", "--port", str(free_port()))
    assert done.returncode == 1, done.stderr[-2000:]
    assert "model '/nonexistent/model' does not exist" in done.stderr
    assert "Traceback" not in done.stderr
