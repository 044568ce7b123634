"""Cluster configuration (the orchestrator's YAML) and the live view of its servers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import yaml

from splitserve.httpd.cors import parse_origins
from splitserve.protocol.cache_salt import check_isolation
from splitserve.protocol.disagg import RELAY_MODES
from splitserve.protocol.internal_api import reported_load, reported_prefill
from splitserve.protocol.membership import parse_target
from splitserve.protocol.prompts import (
    check_template_file, template_file_field, trust_templates_field)
from splitserve.trust import api_keys


@dataclass(frozen=True)
class PoolConfig:
    urls: tuple[str, ...]
    router: str = "round_robin"

    def __post_init__(self):
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
    # How often each worker's reported load is read (GET /health); 0: only with the health
    # checks. Routers weigh Server.load, which is this report plus what was sent since.
    load_poll_interval: float = 0.5
    # Orchestrator processes serving `port` together (SO_REUSEPORT; orchestrator/fleet.py).
    processes: int = 1
    # A registered worker that fails its health checks this long leaves the pools
    # (orchestrator/registry.py); static urls stay whatever happens.
    remove_unhealthy_after: float = 10.0
    # No total timeout: a long stream may run for hours. Each phase has its own bound.
    connect_timeout: float = 5.0        # opening a connection to a worker
    first_byte_timeout: float = 600.0   # request sent -> CTX's whole answer / GEN's first event
    idle_timeout: float = 120.0         # GEN stream: longest wait for its next bytes
    max_retries: int = 2                # failed tries a request survives per pool
    # Past this many client requests in flight, answer 503 at once (the benchmarks hold 1024+).
    max_in_flight: int = 4096
    # A larger client body gets 413: the workers' default (serve --max-body-bytes). It is
    # parsed on the event loop (orjson: ~11 ms per MiB here, every stream waits meanwhile).
    max_body_bytes: int = 64 << 20
    # A generation worker that dies mid-stream: continue the stream on another one from the
    # tokens already sent (orchestrator/migrate.py); off: the stream ends with an error event.
    migrate_streams: bool = True
    # A client that lost a stream may resume it (Last-Event-ID, orchestrator/resume.py) this
    # many seconds after it started; 0: no stream resumes.
    resume_window: float = 600.0
    # Prompts of at most this many tokens (or whose tokens but this many a GEN already
    # caches) are prefilled on the GEN itself, skipping CTX and the KV transfer
    # (orchestrator/decide.py). 0: every prompt goes through CTX.
    local_prefill_max_tokens: int = 0
    # A long prompt is prefilled on a GEN too when the context pool's queue would delay its
    # first token more than that GEN, decoding, would take (orchestrator/queue_prefill.py);
    # give the GENs --max-prefill-tokens-while-decoding so their streams' gaps stay short.
    local_prefill_when_queued: bool = False
    # How many times longer a GEN that runs requests takes to prefill a prompt than a CTX.
    local_prefill_gen_slowdown: float = 2.0
    # The workers' model (a name or path): the orchestrator tokenizes with its tokenizer
    # for the decisions above and KV-aware routing. None: prompts are counted from their
    # bytes only, chat prompts not at all.
    model: str | None = None
    load_format: str = "auto"     # the workers' --load-format: dummy reads only model's config
    # Clients send `Authorization: Bearer <key>` with one of these keys when any is set (in
    # the YAML: one key or a list). Workers prove their identity with internal_secret, and
    # every request to one carries a token derived from it (splitserve/trust.py); the
    # orchestrator does not start without it. Neither is ever logged or sent.
    api_key: tuple[str, ...] = field(default=(), repr=False)
    internal_secret: str | None = field(default=None, repr=False)
    # none | api_key: a client shares prefix-cache blocks only with clients of its own key
    # (protocol/cache_salt.py); the effective salt rides each body sent to a worker.
    cache_isolation: str = "none"
    # The workers' (serve --chat-template, --trust-request-chat-template): the template the
    # orchestrator counts chat prompts with, and whether a request may bring its own (a 400
    # here otherwise, as from a worker). `up` gives both to its workers and itself.
    chat_template: str | None = template_file_field()
    trust_request_chat_template: bool = trust_templates_field()
    # Browser origins allowed cross-origin requests (httpd/cors.py); `*`: any.
    allowed_origins: tuple[str, ...] = ()
    # No log line per finished request (`--disable-log-requests`).
    disable_log_requests: bool = False
    # Where registered workers are kept: None, in this orchestrator (or its fleet's
    # parent); etcd://host:port/prefix, in etcd, shared by every orchestrator watching the
    # prefix (orchestrator/etcd_membership.py, protocol/membership.py).
    membership: str | None = None

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
        if not self.local_prefill_gen_slowdown >= 1:
            raise ValueError(f"local_prefill_gen_slowdown must be 1 or more, got "
                             f"{self.local_prefill_gen_slowdown!r}")
        if not 1 <= self.processes <= 64:
            raise ValueError(f"processes must be 1 to 64, got {self.processes!r}")
        if self.processes > 1 and not self.port:
            raise ValueError("several orchestrator processes share a port: give one (not 0)")
        if self.load_poll_interval < 0:
            raise ValueError(f"load_poll_interval must be 0 or more, got "
                             f"{self.load_poll_interval!r}")
        if self.resume_window < 0:
            raise ValueError(f"resume_window must be 0 (off) or more, got {self.resume_window!r}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be 0 or more, got {self.max_retries!r}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes!r}")
        check_isolation(self.cache_isolation, self.api_key)
        check_template_file(self.chat_template)
        if self.membership is not None:
            parse_target(self.membership)

    @classmethod
    def from_yaml(cls, path: str) -> ClusterConfig:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
        return cls.from_dict(raw, where=path)

    @classmethod
    def from_dict(cls, raw: dict, where: str = "cluster config") -> ClusterConfig:
        # With members in etcd, the static pools may be left out (empty).
        empty = [] if raw.get("membership") else None
        try:
            pools = {k: _pool(raw.pop(k) if empty is None else raw.pop(k, empty))
                     for k in ("context_servers", "generation_servers")}
        except KeyError as exc:
            raise ValueError(f"{where}: missing {exc.args[0]}") from None
        unknown = set(raw) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        if "allowed_origins" in raw:     # a list, or one comma-separated string
            raw["allowed_origins"] = parse_origins(raw["allowed_origins"])
        if "api_key" in raw:
            try:
                raw["api_key"] = api_keys(raw["api_key"])
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
        return cls(**pools, **raw)


def _pool(raw) -> PoolConfig:
    if isinstance(raw, list):
        return PoolConfig(tuple(raw))
    return PoolConfig(tuple(raw.get("urls", ())), raw.get("router", "round_robin"))


class Credentials(NamedTuple):
    """What a server's last identity check proved (trust.py): the instance id it proved,
    the token requests to it carry, and the proof its answers must carry."""
    instance: str
    token: str
    proof: str


@dataclass(eq=False)     # compared by identity: a request's failed tries name these objects
class Server:
    """One worker as this orchestrator sees it. `load` is what routers weigh: the worker's
    last report (GET /health's "load") corrected by this orchestrator's own requests since:
    plus those sent since the report and still open, minus those the report counted that
    have finished (so: reported + in_flight now - in_flight at the report), and never less
    than this orchestrator's own in-flight count. Before any report: that count alone.

    The report is internal_api.reported_load: max(running + waiting, in_flight). Running
    and waiting are the engine's, so they count every front-end process of the worker and
    every orchestrator's requests; in_flight (the answering front-end's open generation
    requests) also counts those not in the engine yet (tokenizing, queued on the ZeroMQ
    socket).

    `prefill_tokens` is the prompt tokens it must compute before they decode, corrected the
    same way: its last report's (internal_api.reported_prefill) plus the prompt tokens of
    this orchestrator's requests prefilling there sent since, minus those the report counted
    that have answered (a finished prompt's whole length: the estimate may run low until
    the next report), never below zero. `local_prefills`: this orchestrator's requests sent
    whole to it and not at their first token yet (orchestrator/queue_prefill.py).

    healthy: routed to. Only after a health check verified the worker's identity (creds)
    and found it serving; cleared, with creds, when it fails or refuses a request."""
    url: str
    healthy: bool = False
    creds: Credentials | None = None
    in_flight: int = 0            # this orchestrator's requests open on it
    static: bool = True           # from the YAML: never leaves the pool
    reported: int | None = None   # the last report's load, None before the first
    _in_flight_at_report: int = 0
    prefill_sent: int = 0         # prompt tokens of this orchestrator's requests prefilling on it
    local_prefills: int = 0
    running: int = 0              # the last report's running requests
    _prefill_reported: int | None = None
    _prefill_sent_at_report: int = 0

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def load(self) -> int:
        if self.reported is None:
            return self.in_flight
        return max(self.reported + self.in_flight - self._in_flight_at_report, self.in_flight)

    @property
    def prefill_tokens(self) -> int:
        if self._prefill_reported is None:
            return self.prefill_sent
        return max(self._prefill_reported + self.prefill_sent - self._prefill_sent_at_report, 0)

    def report(self, load) -> None:
        """load: a worker's /health "load" object; ignored unless it is well-formed."""
        reported = reported_load(load)
        if reported is None:
            return
        self.reported, self._in_flight_at_report = reported, self.in_flight
        prefill = reported_prefill(load)
        if prefill is not None:
            (self._prefill_reported, self.running), self._prefill_sent_at_report = \
                prefill, self.prefill_sent
