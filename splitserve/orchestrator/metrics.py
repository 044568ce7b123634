"""What the orchestrator exports on /metrics, under `splitserve_orchestrator_`."""

from __future__ import annotations

from splitserve.metrics import Counter, Gauge, Histogram, Registry


class OrchestratorMetrics:
    def __init__(self):
        self.registry = r = Registry()
        p = "splitserve_orchestrator_"
        self.requests = r.register(Counter(p + "requests_total", "Requests by endpoint, route and status",
                                           ("endpoint", "route", "status")))
        self.preprocessing = r.register(Histogram(p + "preprocessing_seconds",
                                                  "Client request arrival to CTX request sent"))
        self.ctx = r.register(Histogram(p + "ctx_seconds", "CTX round trip: queue, prefill, first token"))
        self.relay = r.register(Histogram(p + "relay_seconds", "CTX answer to GEN request sent"))
        self.gen_first_byte = r.register(Histogram(p + "gen_first_byte_seconds",
                                                   "GEN request sent to its first event (a whole answer: all of it)"))
        self.e2e = r.register(Histogram(p + "e2e_seconds", "Client arrival to the last byte"))
        self.retries = r.register(Counter(p + "retries_total",
                                          "Tries that failed before any byte reached the client "
                                          "and were tried again, by pool and reason",
                                          ("pool", "reason")))
        self.in_flight = r.register(Gauge(p + "requests_in_flight",
                                          "Client requests being served (past max_in_flight: 503)"))
        self.migrations = r.register(Counter(p + "migrations_total",
                                             "Broken streams continued on another generation "
                                             "worker, by outcome", ("outcome",)))
        self.handoffs = r.register(Counter(p + "handoffs_total",
                                           "Streams continued on another generation worker, by "
                                           "how: kv (their KV pulled from a draining worker) or "
                                           "recompute (prompt and tokens so far prefilled again)",
                                           ("how",)))
        self.relay_modes = r.register(Counter(p + "token_relay_total",
                                              "Requests relayed to GEN, by token relay mode", ("mode",)))
