"""What the planner reads from a worker's /metrics, and the last `window` seconds of it.

A pool's p90 is Prometheus' histogram_quantile over the increase of its members'
histograms within the window, summed across members (prometheus.py's bucket_quantile),
as `histogram_quantile(0.9, sum(increase(...[30s])))` would read it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from splitserve.prometheus import bucket_quantile, parse_prometheus

TTFT = "splitserve_time_to_first_token_seconds"
ITL = "splitserve_inter_token_latency_seconds"


@dataclass(frozen=True)
class Sample:
    """One scrape of one worker: its TTFT and ITL histograms (upper bound -> cumulative
    count) and its engine's requests."""
    ttft: dict[float, float]
    itl: dict[float, float]
    running: float
    waiting: float

    @property
    def load(self) -> float:
        return self.running + self.waiting


def read_sample(text: str | bytes) -> Sample:
    samples = parse_prometheus(text)
    buckets = {TTFT: {}, ITL: {}}
    gauges = {}
    for (name, labels), value in samples.items():
        base = name.removesuffix("_bucket")
        if base in buckets and name.endswith("_bucket"):
            buckets[base][float(dict(labels)["le"])] = value
        elif name in ("splitserve_num_requests_running", "splitserve_num_requests_waiting"):
            gauges[name] = value
    return Sample(buckets[TTFT], buckets[ITL], gauges.get("splitserve_num_requests_running", 0.0),
                  gauges.get("splitserve_num_requests_waiting", 0.0))


def _increase(old: dict[float, float], new: dict[float, float]) -> dict[float, float]:
    return {le: count - old.get(le, 0.0) for le, count in new.items()}


def _reset(old: Sample, new: Sample) -> bool:
    """A counter went back: the worker restarted, its histograms start from zero."""
    return any(new.ttft.get(le, 0.0) < c for le, c in old.ttft.items()) or \
        any(new.itl.get(le, 0.0) < c for le, c in old.itl.items())


class Window:
    """Each worker's scrapes over the last `seconds` (and the one just before, which the
    increase is measured from)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.scrapes: dict[str, deque[tuple[float, Sample]]] = {}

    def add(self, url: str, now: float, sample: Sample) -> None:
        q = self.scrapes.setdefault(url, deque())
        if q and _reset(q[-1][1], sample):
            q.clear()
        q.append((now, sample))
        while len(q) > 1 and q[1][0] <= now - self.seconds:
            q.popleft()

    def keep(self, urls) -> None:
        """Forget workers that are no longer members."""
        for url in set(self.scrapes) - set(urls):
            del self.scrapes[url]

    def restart(self) -> None:
        """From now on (after a move): each worker's latest scrape is its window's start."""
        for q in self.scrapes.values():
            while len(q) > 1:
                q.popleft()

    def latest(self, url: str) -> Sample | None:
        q = self.scrapes.get(url)
        return q[-1][1] if q else None

    def p90(self, urls, histogram: str) -> tuple[float | None, int]:
        """(the 90th percentile in ms, or None; the observations it read) of `histogram`
        ("ttft" or "itl") over these workers' windows."""
        total: dict[float, float] = {}
        for url in urls:
            q = self.scrapes.get(url)
            if not q or len(q) < 2:     # one scrape: no increase measured yet
                continue
            old, new = getattr(q[0][1], histogram), getattr(q[-1][1], histogram)
            for le, count in _increase(old, new).items():
                total[le] = total.get(le, 0.0) + count
        buckets = sorted(total.items())
        observations = int(buckets[-1][1]) if buckets else 0
        return (bucket_quantile(0.9, buckets) if observations else None), observations
