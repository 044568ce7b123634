"""Where `serve` takes its secrets from, and where they go: the worker's config, the engine
process's (pickled across the spawn, keying the KV channel), never a repr."""

import pickle

import pytest

from splitserve.cli import build_parser, server_config
from splitserve.orchestrator.cluster import ClusterConfig


def config(monkeypatch, *argv: str, secret: str | None = "env-secret", key: str | None = "env-key"):
    for name, value in (("SPLITSERVE_INTERNAL_SECRET", secret), ("SPLITSERVE_API_KEY", key)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    return server_config(build_parser().parse_args(["serve", "--model", "tiny-random", *argv]))


def test_serve_takes_the_secrets_from_the_environment(monkeypatch):
    cfg = config(monkeypatch)
    assert (cfg.internal_secret, cfg.api_key) == ("env-secret", ("env-key",))
    assert pickle.loads(pickle.dumps(cfg.engine)).kv.secret == "env-secret"
    for text in (repr(cfg), repr(cfg.engine), str(cfg)):
        assert "env-secret" not in text and "env-key" not in text


def test_the_command_line_wins(monkeypatch):
    cfg = config(monkeypatch, "--internal-secret", "flag-secret", "--api-key", "flag-key")
    assert (cfg.internal_secret, cfg.api_key, cfg.engine.kv.secret) == (
        "flag-secret", ("flag-key",), "flag-secret")


def test_without_either_a_worker_is_open_and_takes_no_internal_request(monkeypatch):
    cfg = config(monkeypatch, secret=None, key=None)
    assert cfg.internal_secret is None and cfg.api_key == () and cfg.engine.kv.secret is None


def test_several_api_keys_as_vllm_spells_them_or_one_flag_each(monkeypatch):
    assert config(monkeypatch, "--api-key", "k1", "k2").api_key == ("k1", "k2")
    assert config(monkeypatch, "--api-key", "k1", "--api-key", "k2").api_key == ("k1", "k2")
    assert config(monkeypatch, key="k1,k2,").api_key == ("k1", "k2")
    cfg = config(monkeypatch, "--cache-isolation", "api_key", key="k1,k2")
    assert cfg.cache_isolation == "api_key" and "k1" not in repr(cfg)


def test_isolation_by_key_needs_keys(monkeypatch):
    with pytest.raises(ValueError, match="cache_isolation api_key needs API keys"):
        config(monkeypatch, "--cache-isolation", "api_key", key=None)


def test_the_cluster_file_takes_one_key_or_a_list():
    pools = {"context_servers": ["http://127.0.0.1:1"], "generation_servers": ["http://127.0.0.1:2"]}
    assert ClusterConfig.from_dict({**pools, "api_key": "k"}).api_key == ("k",)
    cfg = ClusterConfig.from_dict({**pools, "api_key": ["k1", "k2"], "cache_isolation": "api_key"})
    assert cfg.api_key == ("k1", "k2") and "k1" not in repr(cfg)
    for bad in ([], [""], ["k", 3], 5):
        with pytest.raises(ValueError, match="api_key"):
            ClusterConfig.from_dict({**pools, "api_key": bad, "cache_isolation": "api_key"})
    with pytest.raises(ValueError, match="cache_isolation must be one of none, api_key"):
        ClusterConfig.from_dict({**pools, "cache_isolation": "tenant"})
