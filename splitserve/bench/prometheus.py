"""The Prometheus text exposition format (splitserve/metrics.py renders it) read back into
samples, for tests and benchmarks."""

from __future__ import annotations

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
