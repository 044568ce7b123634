"""What one server (a worker front-end, the orchestrator) holds for its clients, and for how
long: the bounds that keep a client that sends slowly, sends too much, or does not read from
costing the server without bound (what uvicorn and h11 guard against, and a little more)."""

from __future__ import annotations

import resource
from dataclasses import dataclass, field, fields

from splitserve.flags import flag

# listen(2) backlog of every HTTP server here, as uvicorn and gunicorn default to
LISTEN_BACKLOG = 2048
FD_HEADROOM = 128      # open files a server process needs besides its connections
INTERNAL_ROOM = 16     # connections kept, at least, for the cluster's own traffic


@dataclass(frozen=True)
class HTTPLimits:
    keepalive_timeout: float = 75.0   # s a keep-alive connection may wait for its next request
    first_byte_timeout: float = 10.0  # s a new connection may take to send anything
    head_timeout: float = field(default=30.0, metadata=flag(   # from the first byte
        "--request-head-timeout", "seconds a request line and headers may take before a 408"))
    body_timeout: float = field(default=60.0, metadata=flag(   # 64 MiB: 1.1 MB/s
        "--request-body-timeout", "seconds a request body may take once its head is in, "
                                  "before a 408"))
    send_timeout: float = 60.0        # s a client may read nothing of what we send it
    max_head_bytes: int = 1 << 20     # an unfinished request head; httptools buffers it whole
    max_header_lines: int = 100       # header lines in one request head
    max_trailers: int = 32            # trailer lines after a chunked body (read and dropped)
    max_chunk_overhead: int = 64 << 10  # bytes of a chunked body that are not body: chunk-size
    #                                     lines, extensions and trailers
    max_pipelined: int = 8            # requests queued behind the one being answered
    max_connections: int = field(default=8192, metadata=flag(   # connections.py: who makes room
        "--max-connections", "clients' open connections; past it a new one closes the longest "
                             "idle one, or is answered 503 when all are busy; the cluster's own "
                             "connections come on top, within the file descriptor limit"))
    max_unproven_per_client: int = 256  # connections of one address that showed no API key

    def __post_init__(self):
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"HTTPLimits.{f.name} must be positive, got "
                                 f"{getattr(self, f.name)!r}")


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (each connection
    holds one; a common soft default is 1,024): -> the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


def connection_budget(limits: HTTPLimits, fd_limit: int,
                      other_fds: int = 0) -> tuple[int, int, int]:
    """(clients' connections, all connections, listen backlog) for a server under fd_limit
    open files, when the process needs other_fds besides them (and FD_HEADROOM for its own
    files, pipes and sockets).

    The loop accepts a whole backlog of waiting connections before a single one reaches the
    server (which may then close it), so the backlog's worth of descriptors is kept free.
    A sixteenth of the rest, at least INTERNAL_ROOM, is kept from clients: the cluster's own
    traffic (heartbeats, registration, requests between its processes) gets in however many
    connections clients hold."""
    room = fd_limit - FD_HEADROOM - other_fds
    backlog = min(LISTEN_BACKLOG, max(16, room // 8))
    budget = max(room - backlog, 2 * INTERNAL_ROOM)
    public = min(limits.max_connections, budget - max(INTERNAL_ROOM, budget // 16))
    return public, budget, backlog
