"""Prometheus metrics without a dependency: Counter, Gauge, Histogram and a Registry that
renders the text exposition format 0.0.4. The worker (server/metrics.py) and the
orchestrator both export theirs with these; prometheus.py parses the text.

Metrics are updated from one thread (the process's event loop); no locks."""

from __future__ import annotations

import bisect
import math
from typing import Iterator, Sequence

# 1 ms .. 60 s: covers a decode step on a GPU up to a long prefill on a CPU.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0)
# 10 us .. 60 s, eight bounds per decade: front-end stages whose cost on an idle loop is well
# below a millisecond, and whose percentiles are read against millisecond targets.
FINE_LATENCY_BUCKETS = tuple(round(m * 10.0 ** e, 12) for e in range(-5, 2)
                             for m in (1, 1.5, 2, 3, 4, 5, 6, 7.5)) + (100.0,)


class _Metric:
    type = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        self.name, self.help, self.labelnames = name, help, tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        self._by_values: dict[tuple, object] = {}   # labels() as called (ints, str) -> child
        if not self.labelnames:
            self._default = self.labels()

    def labels(self, *values) -> object:
        """The child for these label values (in `labelnames` order), made on first use.
        Called per request: the values as given are looked up first, unconverted."""
        child = self._by_values.get(values)
        if child is None:
            key = tuple(str(v) for v in values)
            child = self._children.get(key)
            if child is None:
                if len(key) != len(self.labelnames):
                    raise ValueError(f"{self.name} takes labels {self.labelnames}, got {key}")
                child = self._children[key] = self._new_child()
            self._by_values[values] = child
        return child

    def render(self) -> Iterator[str]:
        yield f"# HELP {self.name} {_escape_help(self.help)}"
        yield f"# TYPE {self.name} {self.type}"
        for key, child in self._children.items():
            yield from self._samples(dict(zip(self.labelnames, key)), child)

    def state(self) -> list[tuple[list[str], list[float]]]:
        """Every child's label values and numbers: what add_state adds to another process's
        copy of this metric (a worker's front-ends sum theirs)."""
        return [(list(key), child.state()) for key, child in self._children.items()]

    def add_state(self, state: list[tuple[list[str], list[float]]]) -> None:
        for key, numbers in state:
            self.labels(*key).add_state(numbers)

    def _new_child(self):
        return _Value()

    def _samples(self, labels: dict, child) -> Iterator[str]:
        yield _sample(self.name, labels, child.value)


class _Value:
    __slots__ = ("value",)

    def __init__(self):
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value

    def state(self) -> list[float]:
        return [self.value]

    def add_state(self, numbers: list[float]) -> None:
        self.value += numbers[0]


class Counter(_Metric):
    type = "counter"

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        self._default.inc(amount)

    def set_total(self, value: float) -> None:
        """Mirror a running total kept elsewhere (the engine process)."""
        self._default.set(value)

    @property
    def total(self) -> float:
        """An unlabelled counter's count."""
        return self._default.value


class Gauge(_Metric):
    type = "gauge"

    def set(self, value: float) -> None:
        self._default.set(value)

    def inc(self, amount: float = 1.0) -> None:
        self._default.inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self._default.dec(amount)


class _HistogramValue:
    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)   # per bucket, not cumulative; last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1   # le: value <= bound
        self.sum += value
        self.count += 1

    def state(self) -> list[float]:
        return [*self.counts, self.sum, self.count]

    def add_state(self, numbers: list[float]) -> None:
        if len(numbers) != len(self.counts) + 2:
            raise ValueError("a histogram state with other buckets")
        for i, n in enumerate(numbers[:-2]):
            self.counts[i] += int(n)
        self.sum += numbers[-2]
        self.count += int(numbers[-1])


class Histogram(_Metric):
    type = "histogram"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = (),
                 buckets: Sequence[float] = LATENCY_BUCKETS):
        self.buckets = tuple(sorted(float(b) for b in buckets if b != math.inf))
        self._le = [repr(b) for b in self.buckets] + ["+Inf"]   # "1.0", as client_python writes
        super().__init__(name, help, labelnames)

    def observe(self, value: float) -> None:
        self._default.observe(value)

    def _new_child(self):
        return _HistogramValue(self.buckets)

    def _samples(self, labels: dict, child: _HistogramValue) -> Iterator[str]:
        cumulative = 0
        for le, count in zip(self._le, child.counts):
            cumulative += count
            yield _sample(self.name + "_bucket", {**labels, "le": le}, cumulative)
        yield _sample(self.name + "_sum", labels, child.sum)
        yield _sample(self.name + "_count", labels, child.count)


class Registry:
    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self):
        self.metrics: dict[str, _Metric] = {}

    def register(self, metric: _Metric) -> _Metric:
        if metric.name in self.metrics:
            raise ValueError(f"metric {metric.name} is already registered")
        self.metrics[metric.name] = metric
        return metric

    def render(self) -> bytes:
        lines = [line for m in self.metrics.values() for line in m.render()]
        return ("\n".join(lines) + "\n").encode()


def _sample(name: str, labels: dict, value: float) -> str:
    if not labels:
        return f"{name} {_format(value)}"
    inner = ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {_format(value)}"


def _format(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    if value != value:
        return "NaN"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")
