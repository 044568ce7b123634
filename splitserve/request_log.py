"""What a server writes to its log about the requests it serves, at INFO: one line per
finished request (its X-Request-Id, route, status, tokens and TTFT where the server knows
them), and, while there is traffic, a line of throughput every STATS_INTERVAL seconds.

A request line is written only for a request past the API-key check (a client without a
key makes no log line: docs/security.md), and only for POST routes (generation, tokenize):
health checks and scrapes, several a second, are not requests anyone looks up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, NamedTuple

logger = logging.getLogger("splitserve.requests")

STATS_INTERVAL = 10.0   # seconds between two throughput lines (vLLM's interval)


def log_finished(prefix: str, request, status: int, started: float, via: str = "") -> None:
    """The line of a finished request. request.outcome (set by the handler), when there is
    one, gives its tokens and TTFT; via: how it was served (the orchestrator's route)."""
    if request.method != "POST" or not logger.isEnabledFor(logging.INFO):
        return      # (nothing built for a line that would not be written)
    out = request.outcome
    tokens = ("" if out is None else
              ", prompt %d tokens, completion %d tokens, TTFT %s" % (
                  out.prompt_tokens, out.completion_tokens,
                  "-" if out.ttft is None else "%.3f s" % out.ttft))
    logger.info("%s: request %s %s %d%s%s, %.3f s", prefix, request.id, request.path, status,
                f" via {via}" if via else "", tokens, time.time() - started)


class Totals(NamedTuple):
    """A server's counts now: tokens since start, requests running and waiting, KV use."""
    prompt_tokens: float
    generation_tokens: float
    running: int
    waiting: int
    kv_usage: float


async def log_throughput(prefix: str, totals: Callable[[], Totals],
                         interval: float = STATS_INTERVAL) -> None:
    """Every `interval` seconds, the tokens per second since the last line, the requests
    running and waiting and the KV cache's use; nothing while the server is idle."""
    last, at = totals(), time.monotonic()
    while True:
        await asyncio.sleep(interval)
        now, t = totals(), time.monotonic()
        if idle(last, now):
            last, at = now, t
            continue
        span = max(t - at, 1e-9)
        logger.info("%s: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: "
                    "%.1f tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%",
                    prefix, (now.prompt_tokens - last.prompt_tokens) / span,
                    (now.generation_tokens - last.generation_tokens) / span, now.running,
                    now.waiting, 100.0 * now.kv_usage)
        last, at = now, t


def idle(before: Totals, now: Totals) -> bool:
    """No token moved between the two and no request is running or waiting."""
    return (now.prompt_tokens == before.prompt_tokens
            and now.generation_tokens == before.generation_tokens
            and now.running == 0 and now.waiting == 0)
