"""Waiting for Ctrl-C / SIGTERM inside an asyncio program."""

from __future__ import annotations

import asyncio
import signal
from typing import Callable


async def wait_for_stop_signal(should_stop: Callable[[], bool] | None = None) -> None:
    """Return on SIGINT or SIGTERM, or once should_stop() (checked every second) is true."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set():
        if should_stop is not None and should_stop():
            return
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass
