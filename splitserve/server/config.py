"""Worker (front-end) configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.config import EngineConfig
from splitserve.flags import flag, flags_within
from splitserve.httpd.cors import parse_origins
from splitserve.httpd.limits import HTTPLimits
from splitserve.protocol.cache_salt import check_isolation
from splitserve.protocol.membership import parse_target
from splitserve.protocol.prompts import (
    check_template_file, template_file_field, trust_templates_field)
from splitserve.protocol.roles import WORKER_ROLES
from splitserve.protocol.tool_parsers import check_tool_parser, tool_parser_field
from splitserve.trust import new_instance_id


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata=flag(
        "--host", "address the HTTP server listens on, 0.0.0.0: every interface"))
    port: int = field(default=8000, metadata=flag("--port", "port of the HTTP server"))
    # A deployment label: what a request does, its own disaggregated_params say.
    role: str = field(default="agg", metadata=flag(
        "--role", "the pool --register joins: ctx the context pool, gen and agg the generation "
                  "pool", choices=WORKER_ROLES))
    served_model_name: str | None = field(default=None, metadata=flag(
        "--served-model-name", "the model's name in /v1/models and in responses (default: "
                               "the model's own)"))
    max_body_bytes: int = field(default=64 << 20, metadata=flag(
        "--max-body-bytes", "larger request bodies get 413"))
    tokenizer_threads: int = 2
    # protocol/prompts.py: the chat template of every chat request, and whether a request
    # may bring its own (protocol/openai_fields.refuse_request_template)
    chat_template: str | None = template_file_field()
    trust_request_chat_template: bool = trust_templates_field()
    # protocol/tool_parsers: the format tool calls are parsed from (None: the model family's)
    tool_call_parser: str | None = tool_parser_field()
    # A request's grammar (structured output, tool calling) compiles in the tokenizer pool
    # within this, else a 400 naming its field (server/generate.py)
    grammar_compile_seconds: float = field(default=10.0, metadata=flag(
        "--grammar-compile-seconds", "a request whose grammar takes longer to compile gets "
                                     "400 (structured output, tool calling)"))
    engine_start_timeout: float = 600.0
    # Requests waiting for the engine (submitted, not running) past which new ones get 503 +
    # Retry-After instead of a place in an unbounded queue. Far above what the benchmarks
    # hold (1024 in flight): a bound on memory and latency, not a scheduling knob.
    max_waiting_requests: int = field(default=4096, metadata=flag(
        "--max-waiting-requests", "requests waiting for the engine past which new ones are "
                                  "refused at once, with 503 and Retry-After"))
    engine_stall_seconds: float = field(default=60.0, metadata=flag(
        "--engine-stall-seconds", "/health answers 503 when the engine completed no step for "
                                  "this long while holding requests; longer than the longest "
                                  "step"))
    http: HTTPLimits = field(default_factory=HTTPLimits, metadata=flags_within())  # timeouts, caps
    # Public endpoints need `Authorization: Bearer <key>` with one of these keys when any is
    # set; internal requests (anything carrying disaggregated_params) need the token derived
    # from the internal secret for instance_id (splitserve/trust.py). Never logged.
    api_key: tuple[str, ...] = field(default=(), repr=False)
    internal_secret: str | None = field(default=None, repr=False)
    # none | api_key: whose prefix-cache blocks a public client may share
    # (protocol/cache_salt.py); api_key: only those of clients with its own key.
    cache_isolation: str = "none"
    engine: EngineConfig = field(default_factory=EngineConfig)
    # server/frontends.py
    api_server_count: int = field(default=1, metadata=flag(
        "--api-server-count", "HTTP front-end processes on the port, sharing one engine process",
        aliases=("--frontends",)))
    # registration.py
    register: str | None = field(default=None, metadata=flag(
        "--register", "join this orchestrator's pools while serving; leave on a clean stop",
        metavar="ORCH_URL"))
    # etcd_registration.py
    membership: str | None = field(default=None, metadata=flag(
        "--membership", "join the cluster's members in etcd while serving (a lease, renewed; "
                        "revoked on a clean stop); ?ttl=S: the lease's seconds",
        metavar="etcd://HOST:PORT/PREFIX"))
    # drain.py: how long a stopping worker waits for its streams to be handed off, its
    # requests to end and its KV leases to be pulled.
    drain_grace_seconds: float = field(default=10.0, metadata=flag(
        "--drain-grace-seconds", "on SIGTERM, at most this long to hand live streams to other "
                                 "generation workers (by moving their KV), finish the rest and "
                                 "have leased KV pulled, before stopping"))
    disable_log_requests: bool = field(default=False, metadata=flag(
        "--disable-log-requests", "no log line per finished request (id, route, status, "
                                  "tokens, TTFT)"))
    disable_log_stats: bool = field(default=False, metadata=flag(
        "--disable-log-stats", "no throughput line every 10 s while there is traffic"))
    allowed_origins: tuple[str, ...] = field(default=(), metadata=flag(
        "--allowed-origins", "browser origins allowed cross-origin requests (CORS), "
                             "comma-separated, * for any (default: none)", type=parse_origins))
    # This worker's instance id (trust.py): made with the serve process's config, so its
    # front-ends (--api-server-count), which get this config, share it; a restarted worker
    # has a new one.
    instance_id: str = field(default_factory=new_instance_id)

    def __post_init__(self):
        if self.role not in WORKER_ROLES:
            raise ValueError(f"role must be one of {', '.join(WORKER_ROLES)}, got {self.role!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        if self.max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be at least 1")
        if self.api_server_count < 1:
            raise ValueError(f"api_server_count must be at least 1, got {self.api_server_count}")
        if not self.grammar_compile_seconds > 0:
            raise ValueError("grammar_compile_seconds must be positive")
        if not self.drain_grace_seconds >= 0:
            raise ValueError("drain_grace_seconds must be at least 0")
        if not self.engine_stall_seconds > 0:
            raise ValueError("engine_stall_seconds must be positive")
        check_isolation(self.cache_isolation, self.api_key)
        check_template_file(self.chat_template)
        check_tool_parser(self.tool_call_parser)
        if self.membership is not None:
            parse_target(self.membership)
            if self.register:
                raise ValueError("--membership and --register both say where this worker "
                                 "joins: give one")
            if not self.internal_secret:
                raise ValueError("--membership needs the cluster's internal secret: the "
                                 "orchestrators take only records signed with it")

    @property
    def log_prefix(self) -> str:
        return f"{self.role}:{self.port}"
