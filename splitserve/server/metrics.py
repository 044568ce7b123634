"""Prometheus metrics without a dependency: Counter, Gauge, Histogram, a Registry that
renders the text exposition format 0.0.4, a parser for tests and benchmarks, and the
worker's own metrics (`ServerMetrics`).

Metrics are updated from one thread (the front-end's event loop); no locks."""

from __future__ import annotations

import bisect
import math
import re
import time
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


class Counter(_Metric):
    type = "counter"

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        self._default.inc(amount)

    def set_total(self, value: float) -> None:
        """Mirror a running total kept elsewhere (the engine process)."""
        self._default.set(value)


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


# -- parsing ----------------------------------------------------------------------------------
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


# -- the worker's metrics ---------------------------------------------------------------------
class ServerMetrics:
    """Everything a worker exports under `splitserve_`. The front-end records per request;
    `update_engine` copies the engine's periodic stats."""

    def __init__(self, prefix: str = "splitserve_"):
        self.registry = r = Registry()

        def add(cls, name: str, help: str, *labels: str):
            return r.register(cls(prefix + name, help, labels))
        self.requests = add(Counter, "requests_total", "HTTP requests by endpoint and status code",
                            "endpoint", "status")
        self.ttft = add(Histogram, "time_to_first_token_seconds",
                        "Arrival to first generated token")
        self.itl = add(Histogram, "inter_token_latency_seconds",
                       "Time between consecutive tokens of a streamed sequence (a "
                       "response sent whole gets its tokens at once)")
        self.e2e = add(Histogram, "e2e_request_latency_seconds", "Arrival to last token")
        self.queue = add(Histogram, "request_queue_time_seconds",
                         "Engine admission to first scheduled (waiting for the running step included)")
        self.prefill = add(Histogram, "prefill_seconds",
                           "First scheduled to first token (a generation_only request: the KV pull)")
        self.preprocessing = add(Histogram, "preprocessing_seconds",
                                 "Sent (X-Sent-At) or HTTP arrival to engine admission (the engine "
                                 "process took it off its input socket)")
        self.gen_preprocessing = r.register(Histogram(
            prefix + "gen_preprocessing_seconds",
            "generation_only: sent (X-Sent-At) or arrival to engine admission",
            buckets=FINE_LATENCY_BUCKETS))
        self.kv_transfer = add(Histogram, "kv_transfer_seconds",
                               "generation_only: time to pull the prompt's KV from the context worker")
        self.token_relay = add(Counter, "token_relay_total",
                               "generation_only requests by how their prompt was relayed", "mode")
        self.prompt_tokens = add(Counter, "prompt_tokens_total", "Prompt tokens processed")
        self.generation_tokens = add(Counter, "generation_tokens_total", "Generated tokens")
        self.shed = add(Counter, "requests_shed_total",
                        "Generation requests refused with 503 because too many were waiting")
        self.engine_restarts = add(Counter, "engine_restarts_total",
                                   "Times the engine process was started again after it stopped")
        self.running = add(Gauge, "num_requests_running", "Requests in the engine's running batch")
        self.waiting = add(Gauge, "num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_used = add(Gauge, "kv_blocks_used", "KV cache blocks in use")
        self.kv_total = add(Gauge, "kv_blocks_total", "KV cache blocks in the pool")
        self.kv_usage = add(Gauge, "kv_cache_usage", "Fraction of KV cache blocks in use (0..1)")
        self.kv_leased = add(Gauge, "kv_blocks_leased",
                             "KV blocks held for generation workers to pull")
        self.prefix_queries = add(Counter, "prefix_cache_queries_total",
                                  "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = add(Counter, "prefix_cache_hits_total",
                               "Prompt tokens found in the prefix cache")
        # The Prometheus client's standard name, unprefixed: this front-end process only
        # (all its threads), not the engine-core process.
        self.process_cpu = r.register(Counter("process_cpu_seconds_total",
                                              "User and system CPU time of this front-end process"))

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, status).inc()

    def update_engine(self, stats) -> None:
        """stats: protocol.engine.EngineStats (running, waiting, KV blocks, prefix cache)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.set_kv_blocks(stats.kv_blocks_used, stats.kv_blocks_total)
        self.kv_leased.set(stats.kv_blocks_leased)
        self.prefix_queries.set_total(stats.prefix_cache_queries)
        self.prefix_hits.set_total(stats.prefix_cache_hits)

    def update_process(self) -> None:
        """Called when /metrics is scraped."""
        self.process_cpu.set_total(time.process_time())

    def set_kv_blocks(self, used: int, total: int) -> None:
        self.kv_used.set(used)
        self.kv_total.set(total)
        self.kv_usage.set(used / total if total else 0.0)

    def render(self) -> bytes:
        return self.registry.render()
