"""Where `serve` takes its secrets from, and where they go: the worker's config, the engine
process's (pickled across the spawn, keying the KV channel), never a repr."""

import pickle

from splitserve.cli import build_parser, server_config


def config(monkeypatch, *argv: str, secret: str | None = "env-secret", key: str | None = "env-key"):
    for name, value in (("SPLITSERVE_INTERNAL_SECRET", secret), ("SPLITSERVE_API_KEY", key)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    return server_config(build_parser().parse_args(["serve", "--model", "tiny-random", *argv]))


def test_serve_takes_the_secrets_from_the_environment(monkeypatch):
    cfg = config(monkeypatch)
    assert (cfg.internal_secret, cfg.api_key) == ("env-secret", "env-key")
    assert pickle.loads(pickle.dumps(cfg.engine)).kv.secret == "env-secret"
    for text in (repr(cfg), repr(cfg.engine), str(cfg)):
        assert "env-secret" not in text and "env-key" not in text


def test_the_command_line_wins(monkeypatch):
    cfg = config(monkeypatch, "--internal-secret", "flag-secret", "--api-key", "flag-key")
    assert (cfg.internal_secret, cfg.api_key, cfg.engine.kv.secret) == (
        "flag-secret", "flag-key", "flag-secret")


def test_without_either_a_worker_is_open_and_takes_no_internal_request(monkeypatch):
    cfg = config(monkeypatch, secret=None, key=None)
    assert cfg.internal_secret is None and cfg.api_key is None and cfg.engine.kv.secret is None
