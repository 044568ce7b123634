"""The `none` KV transport: moves no bytes, for measuring the GEN front-end alone.

A generation_only request's pull succeeds at once and copies nothing, so its blocks keep
whatever KV they last held and its output is garbage. `splitserve bench frontend` runs its
GEN worker with it: what is left to measure is reading, checking and admitting relayed
requests, with no context worker behind them. Never serve users with it.

Nothing listens: the endpoint it reports (tcp://<host>:0) names no server, and a
context_only request's lease is never pulled, so it lasts until it expires.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from splitserve.kv.base import KVTransport, LeaseView, PullResult, register
from splitserve.protocol.engine import KVHandle

logger = logging.getLogger(__name__)


@register("none")
class NoneTransport(KVTransport):
    def __init__(self, kv_cache, layout: str, host: str = "127.0.0.1", platform=None, **_unused):
        super().__init__(kv_cache, layout, platform)
        self.host = host

    def start(self, leases: LeaseView) -> str:
        logger.warning("engine: KV transport none: generation_only requests skip their KV pull "
                       "and decode from stale blocks; output is garbage (benchmark only)")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:0"

    def pull(self, handle: KVHandle, dst_blocks: np.ndarray, done: Callable[[PullResult], None],
             skip: int = 0, with_tokens: bool = False) -> None:
        # On the caller's thread: there is no transport thread. No tokens either: a request
        # that needs its prompt's values fails.
        done(PullResult(ok=True))

    def close(self) -> None:
        pass
