"""Two servers measured one at a time, in alternating order, over several rounds: the order
they run in, and what the rounds add up to (each server's median per metric, the ratio of
the medians, and every round's own number, so the noise between rounds stays visible).

A round record is what reference.py writes for one server in one round:
{"round": i, "server": name, "runs": {label: {"rows": [...], "workload": {...},
"background": cores} or {"error": text}}, ...}; its rows are `bench serve` comparison rows
(compare.rows), one per concurrency level."""

from __future__ import annotations

import statistics

from splitserve.bench.serve.compare import COLUMNS, rows

KEYS = tuple(key for key, _, _ in COLUMNS)


def schedule(servers: tuple[str, str], rounds: int) -> list[tuple[int, str]]:
    """(round, server) in running order: A, B in even rounds, B, A in odd ones, so neither
    server always runs first (or last) on a machine whose speed drifts."""
    if rounds < 2:
        raise ValueError(f"an alternating comparison needs at least 2 rounds, got {rounds}")
    return [(i, s) for i in range(rounds) for s in (servers if i % 2 == 0 else servers[::-1])]


def run_rows(doc: dict, server: str) -> list[dict]:
    """The rows of one `bench serve` result: a sweep (several levels) has them; a single run
    is made into its one row."""
    found = doc["rows"] if "rows" in doc else rows([doc], [server])
    return [{**r, "server": server} for r in found]


def _median(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def combine(records: list[dict], ours: str, theirs: str) -> dict:
    """{(label, concurrency): {"servers": {name: {"rounds": [row | None, ...] in round order,
    "median": {key: value}, "completed", "failed"}}, "ratio": {key: ours' median / theirs'}}}.
    A round whose run failed leaves None in its place; medians are over the rounds that ran."""
    rounds = sorted({r["round"] for r in records})
    found: dict = {}
    for rec in records:
        for label, run in rec["runs"].items():
            for row in run.get("rows", []):
                cell = found.setdefault((label, row["concurrency"]), {}).setdefault(
                    rec["server"], [None] * len(rounds))
                cell[rounds.index(rec["round"])] = row
    out = {}
    for point, by_server in found.items():
        servers = {name: _server(got) for name, got in by_server.items()}
        out[point] = {"servers": servers, "ratio": _ratio(servers.get(ours), servers.get(theirs))}
    return out


def _server(got: list[dict | None]) -> dict:
    ran = [r for r in got if r is not None]
    return {"rounds": got, "median": {k: _median([r[k] for r in ran]) for k in KEYS},
            "completed": sum(r["completed"] for r in ran),
            "failed": sum(r["failed"] for r in ran)}


def _ratio(ours: dict | None, theirs: dict | None) -> dict:
    if ours is None or theirs is None:
        return {k: None for k in KEYS}
    a, b = ours["median"], theirs["median"]
    return {k: a[k] / b[k] if a[k] is not None and b[k] else None for k in KEYS}
