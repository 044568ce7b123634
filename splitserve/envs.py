"""Every environment variable splitserve reads, in one place."""

from __future__ import annotations

import os


def log_level() -> str:
    """SPLITSERVE_LOG_LEVEL: logging level of every splitserve process (default INFO)."""
    return os.environ.get("SPLITSERVE_LOG_LEVEL", "INFO").upper()


def num_threads() -> int | None:
    """SPLITSERVE_NUM_THREADS: torch intra-op threads of engine processes when the command
    line does not say (default: torch's choice)."""
    value = os.environ.get("SPLITSERVE_NUM_THREADS")
    return int(value) if value else None
