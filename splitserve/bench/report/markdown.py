"""The markdown of `splitserve bench report`: a page section, and tables, numbers, command
lines and failures as the page shows them."""

from __future__ import annotations

import shlex
from dataclasses import dataclass


@dataclass
class Section:
    title: str
    body: str
    summary: str = ""      # one clause for the page's summary paragraph


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def num(value, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def stats(s: dict, keys=("p50", "p90", "p99")) -> str:
    """'p50 / p90 / p99' of a latency_stats dict in ms, whole ms from 100 up."""
    return " / ".join(num(s.get(k), 0 if (s.get(k) or 0) >= 100 else 1) for k in keys)


def shown(cmd: list[str]) -> str:
    return shlex.join(cmd)


def commands(cmds: list[list[str]]) -> str:
    return "Commands:\n\n```bash\n" + "\n".join(shown(c) for c in cmds) + "\n```"


def failed(exc: BaseException) -> str:
    return f"**FAILED** ({type(exc).__name__}):\n\n```\n{str(exc).strip()}\n```"


def failed_cell(exc: Exception) -> str:
    """A failed step in one table cell: the first line of its error."""
    return f"failed: {str(exc).splitlines()[0]}"
