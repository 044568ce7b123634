"""Cluster configuration (the orchestrator's YAML) and the live view of its servers."""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml

RELAY_MODES = ("list", "b64", "metadata", "auto")


@dataclass(frozen=True)
class PoolConfig:
    urls: tuple[str, ...]
    router: str = "round_robin"

    def __post_init__(self):
        if not self.urls:
            raise ValueError("a server pool needs at least one url")
        from splitserve.orchestrator.routers import ROUTERS
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; known: {', '.join(ROUTERS)}")


@dataclass(frozen=True)
class ClusterConfig:
    context_servers: PoolConfig
    generation_servers: PoolConfig
    host: str = "127.0.0.1"
    port: int = 8000
    token_relay: str = "auto"     # how prompt tokens travel CTX -> GEN (orchestrator/relay.py)
    health_check_interval: float = 2.0
    # No total timeout: a long stream may run for hours. Each phase has its own bound.
    connect_timeout: float = 5.0        # opening a connection to a worker
    first_byte_timeout: float = 600.0   # request sent -> CTX's whole answer / GEN's first event
    idle_timeout: float = 120.0         # GEN stream: longest wait for its next bytes
    max_retries: int = 2                # failed tries a request survives per pool
    # Past this many client requests in flight, answer 503 at once (the benchmarks hold 1024+).
    max_in_flight: int = 4096
    # A generation worker that dies mid-stream: continue the stream on another one from the
    # tokens already sent (orchestrator/migrate.py); off: the stream ends with an error event.
    migrate_streams: bool = True
    # Clients send `Authorization: Bearer <api_key>` when it is set. Every request to a
    # worker carries internal_secret (splitserve/trust.py); the orchestrator does not start
    # without it. Neither is ever logged.
    # Prompts of at most this many tokens (or whose tokens but this many a GEN already
    # caches) are prefilled on the GEN itself, skipping CTX and the KV transfer
    # (orchestrator/decide.py). 0: every prompt goes through CTX.
    local_prefill_max_tokens: int = 0
    # The workers' model (a name or path): the orchestrator tokenizes with its tokenizer
    # for the decision above and KV-aware routing. None: prompts are counted from their
    # bytes only, chat prompts not at all.
    model: str | None = None
    api_key: str | None = field(default=None, repr=False)
    internal_secret: str | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.token_relay not in RELAY_MODES:
            raise ValueError(f"token_relay must be one of {', '.join(RELAY_MODES)}, "
                             f"got {self.token_relay!r}")
        for name in ("connect_timeout", "first_byte_timeout", "idle_timeout", "max_in_flight"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens must be 0 (off) or more, got "
                             f"{self.local_prefill_max_tokens!r}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be 0 or more, got {self.max_retries!r}")

    @classmethod
    def from_yaml(cls, path: str) -> ClusterConfig:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
        return cls.from_dict(raw, where=path)

    @classmethod
    def from_dict(cls, raw: dict, where: str = "cluster config") -> ClusterConfig:
        try:
            pools = {k: _pool(raw.pop(k)) for k in ("context_servers", "generation_servers")}
        except KeyError as exc:
            raise ValueError(f"{where}: missing {exc.args[0]}") from None
        unknown = set(raw) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        return cls(**pools, **raw)


def _pool(raw) -> PoolConfig:
    if isinstance(raw, list):
        return PoolConfig(tuple(raw))
    return PoolConfig(tuple(raw.get("urls", ())), raw.get("router", "round_robin"))


@dataclass
class Server:
    url: str
    healthy: bool = True
    in_flight: int = 0

    @property
    def load(self) -> float:
        """What routers weigh: requests in flight from this orchestrator (for now)."""
        return self.in_flight

    def __hash__(self) -> int:
        return hash(self.url)
