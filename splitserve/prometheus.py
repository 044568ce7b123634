"""The Prometheus text exposition format (splitserve/metrics.py renders it) read back into
samples, and a histogram's quantile from its buckets, for the planner, benchmarks and
tests."""

from __future__ import annotations

import math
import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse_prometheus(text: str | bytes) -> dict[tuple[str, frozenset], float]:
    """Exposition text -> {(sample name, frozenset of (label, value)): value}."""
    if isinstance(text, bytes):
        text = text.decode()
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ValueError(f"not a Prometheus sample line: {line!r}")
        name, labels, value = match.groups()
        out[(name, frozenset(_parse_labels(labels or "").items()))] = float(value)
    return out


def _parse_labels(text: str) -> dict[str, str]:
    labels, pos = {}, 0
    while pos < len(text):
        match = _LABEL.match(text, pos)
        if match is None:
            raise ValueError(f"bad labels: {{{text}}}")
        labels[match.group(1)] = re.sub(r"\\.", lambda m: _UNESCAPE.get(m.group(0), m.group(0)),
                                        match.group(2))
        pos = match.end()
    return labels


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus histogram_quantile: linear inside the bucket holding the q-th observation
    (cumulative counts); the +Inf bucket answers with the largest finite bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return 1000 * lower_bound
            inside = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return 1000 * (lower_bound + (bound - lower_bound) * inside)
        lower_bound, lower_count = bound, count
    return 1000 * lower_bound
