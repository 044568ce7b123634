"""The worker's own metrics (`ServerMetrics`), built on the primitives of splitserve/metrics.py.

With several front-end processes (`serve --api-server-count N`) each counts what it serves;
/metrics on any of them renders the sum of its own and the others' last reports
(protocol/frontends.py), so a scrape sees the worker, not one process."""

from __future__ import annotations

import time

from splitserve.metrics import FINE_LATENCY_BUCKETS, Counter, Gauge, Histogram, Registry


class ServerMetrics:
    """Everything a worker exports under `splitserve_`. The front-end records per request;
    `update_engine` copies the engine's periodic stats."""

    def __init__(self, prefix: str = "splitserve_"):
        self.registry = r = Registry()
        self.prefix = prefix

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
        self.prefill_tokens = add(Gauge, "num_prefill_tokens",
                                  "Prompt tokens the engine must still compute (waiting and "
                                  "running prefills; pulled prompts not)")
        self.kv_used = add(Gauge, "kv_blocks_used", "KV cache blocks in use")
        self.kv_total = add(Gauge, "kv_blocks_total", "KV cache blocks in the pool")
        self.kv_usage = add(Gauge, "kv_cache_usage", "Fraction of KV cache blocks in use (0..1)")
        self.kv_leased = add(Gauge, "kv_blocks_leased",
                             "KV blocks held for generation workers to pull")
        self.prefix_queries = add(Counter, "prefix_cache_queries_total",
                                  "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = add(Counter, "prefix_cache_hits_total",
                               "Prompt tokens found in the prefix cache")
        # generation_only pulls, by EngineStats field: what moved, and what the cache had
        self.kv_pulls = {field: add(Counter, name, f"generation_only: {what}")
                         for field, name, what in (
            ("kv_bytes_pulled", "kv_pulled_bytes_total", "KV bytes pulled from context workers"),
            ("kv_blocks_pulled", "kv_pulled_blocks_total", "KV blocks pulled from context workers"),
            ("kv_blocks_reused", "kv_reused_blocks_total",
             "prompt KV blocks found in the prefix cache instead of pulled"))}
        # The Prometheus client's standard name, unprefixed: this front-end process only
        # (all its threads), not the engine-core process.
        self.process_cpu = r.register(Counter("process_cpu_seconds_total",
                                              "User and system CPU time of this front-end process"))

        # Copies of the engine's stats: the same in every front-end, so never summed.
        self.engine_wide = {m.name for m in (
            self.engine_restarts, self.running, self.waiting, self.prefill_tokens, self.kv_used,
            self.kv_total,
            self.kv_usage, self.kv_leased, self.prefix_queries, self.prefix_hits,
            *self.kv_pulls.values())}

    def frontend_state(self) -> dict:
        """What this front-end counted itself (protocol.frontends.MetricsState)."""
        return {name: m.state() for name, m in self.registry.metrics.items()
                if name not in self.engine_wide}

    def absorb(self, state: dict) -> None:
        """Add a frontend_state() to this one's: a restarted front-end carries on the
        counts of the one it replaces (a Prometheus counter never goes down)."""
        for name, numbers in state.items():
            self.registry.metrics[name].add_state(numbers)

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, status).inc()

    def update_engine(self, stats) -> None:
        """stats: protocol.engine.EngineStats (running, waiting, KV blocks, prefix cache)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.prefill_tokens.set(stats.num_prefill_tokens)
        self.set_kv_blocks(stats.kv_blocks_used, stats.kv_blocks_total)
        self.kv_leased.set(stats.kv_blocks_leased)
        self.prefix_queries.set_total(stats.prefix_cache_queries)
        self.prefix_hits.set_total(stats.prefix_cache_hits)
        for field, counter in self.kv_pulls.items():
            counter.set_total(getattr(stats, field, 0))   # 0: stats from before the field

    def update_process(self) -> None:
        """Called when /metrics is scraped."""
        self.process_cpu.set_total(time.process_time())

    def set_kv_blocks(self, used: int, total: int) -> None:
        self.kv_used.set(used)
        self.kv_total.set(total)
        self.kv_usage.set(used / total if total else 0.0)

    def render(self, peers: dict[int, dict] | None = None, me: int = 0) -> bytes:
        """peers: the other front-ends' last frontend_state() by front-end number; their
        sum with this one's is rendered, and how many requests each answered."""
        if not peers:
            return self.registry.render()
        total = ServerMetrics(self.prefix)
        per_frontend = total.registry.register(Counter(
            self.prefix + "frontend_requests_total",
            "HTTP requests answered by each front-end process of this worker", ("frontend",)))
        for name, metric in self.registry.metrics.items():
            total.registry.metrics[name].add_state(metric.state())
        count = self.prefix + "requests_total"
        per_frontend.labels(me).add_state([_requests(self.frontend_state(), count)])
        for peer, state in sorted(peers.items()):
            for name, numbers in state.items():
                total.registry.metrics[name].add_state(numbers)
            per_frontend.labels(peer).add_state([_requests(state, count)])
        return total.registry.render()


def _requests(state: dict, name: str) -> float:
    return sum(numbers[0] for _, numbers in state.get(name, ()))
