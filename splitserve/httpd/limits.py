"""What one server (a worker front-end, the orchestrator) holds for its clients, and for how
long: the bounds that keep a client that sends slowly, sends too much, or does not read from
costing the server without bound (what uvicorn and h11 guard against, and a little more)."""

from __future__ import annotations

from dataclasses import dataclass, fields

# listen(2) backlog of every HTTP server here, as uvicorn and gunicorn default to
LISTEN_BACKLOG = 2048


@dataclass(frozen=True)
class HTTPLimits:
    keepalive_timeout: float = 75.0   # s a keep-alive connection may wait for its next request
    head_timeout: float = 30.0        # s a request line and headers may take from first byte
    body_timeout: float = 60.0        # s a body may take once its head is in (64 MiB: 1.1 MB/s)
    send_timeout: float = 60.0        # s a client may read nothing of what we send it
    max_head_bytes: int = 1 << 20     # an unfinished request head; httptools buffers it whole
    max_header_lines: int = 100       # header lines in one request head
    max_trailers: int = 32            # trailer lines after a chunked body (read and dropped)
    max_chunk_overhead: int = 64 << 10  # bytes of a chunked body that are not body: chunk-size
    #                                     lines, extensions and trailers
    max_pipelined: int = 8            # requests queued behind the one being answered
    max_connections: int = 8192       # open connections; one more is answered 503 and closed

    def __post_init__(self):
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"HTTPLimits.{f.name} must be positive, got "
                                 f"{getattr(self, f.name)!r}")
