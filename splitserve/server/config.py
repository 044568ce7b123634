"""Worker (front-end) configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.config import EngineConfig
from splitserve.httpd.limits import HTTPLimits
from splitserve.protocol.cache_salt import check_isolation
from splitserve.protocol.roles import WORKER_ROLES
from splitserve.trust import new_instance_id


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    role: str = "agg"                      # a deployment label; requests choose what they do
    served_model_name: str | None = None   # None: the model's own name
    max_body_bytes: int = 64 << 20         # larger bodies get 413
    tokenizer_threads: int = 2
    engine_start_timeout: float = 600.0
    # Requests waiting for the engine (submitted, not running) past which new ones get 503 +
    # Retry-After instead of a place in an unbounded queue. Far above what the benchmarks
    # hold (1024 in flight): a bound on memory and latency, not a scheduling knob.
    max_waiting_requests: int = 4096
    engine_stall_seconds: float = 60.0     # no engine step this long, holding work: /health 503
    http: HTTPLimits = field(default_factory=HTTPLimits)   # timeouts, caps (httpd/limits.py)
    # Public endpoints need `Authorization: Bearer <key>` with one of these keys when any is
    # set; internal requests (anything carrying disaggregated_params) need the token derived
    # from the internal secret for instance_id (splitserve/trust.py). Never logged.
    api_key: tuple[str, ...] = field(default=(), repr=False)
    internal_secret: str | None = field(default=None, repr=False)
    # none | api_key: whose prefix-cache blocks a public client may share
    # (protocol/cache_salt.py); api_key: only those of clients with its own key.
    cache_isolation: str = "none"
    engine: EngineConfig = field(default_factory=EngineConfig)
    # HTTP front-end processes sharing the port and one engine process (server/frontends.py)
    api_server_count: int = 1
    register: str | None = None    # an orchestrator's url to register with (registration.py)
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
        if not self.engine_stall_seconds > 0:
            raise ValueError("engine_stall_seconds must be positive")
        check_isolation(self.cache_isolation, self.api_key)

    @property
    def log_prefix(self) -> str:
        return f"{self.role}:{self.port}"
