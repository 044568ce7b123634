"""Prometheus metrics: what we render parses back to the same numbers."""

from types import SimpleNamespace

import pytest

from splitserve.prometheus import parse_prometheus
from splitserve.metrics import Counter, Gauge, Histogram, Registry
from splitserve.server.metrics import ServerMetrics


def key(name, **labels):
    return name, frozenset(labels.items())


def test_render_parse_round_trip():
    reg = Registry()
    c = reg.register(Counter("reqs_total", "Requests", ["endpoint", "status"]))
    g = reg.register(Gauge("running", "Running requests"))
    c.labels("/v1/completions", 200).inc()
    c.labels("/v1/completions", 200).inc(2)
    c.labels("/v1/chat/completions", 400).inc()
    c.labels("/v1/chat/completions", "400").inc()     # the same series as 400
    g.set(3)
    g.dec(0.5)
    text = reg.render().decode()
    assert "# HELP reqs_total Requests\n# TYPE reqs_total counter\n" in text
    assert "# TYPE running gauge" in text and text.endswith("\n")
    m = parse_prometheus(text)
    assert m == {key("reqs_total", endpoint="/v1/completions", status="200"): 3.0,
                 key("reqs_total", endpoint="/v1/chat/completions", status="400"): 2.0,
                 key("running"): 2.5}


def test_histogram_buckets_are_cumulative():
    reg = Registry()
    h = reg.register(Histogram("lat_seconds", "Latency", buckets=[0.1, 1.0, 10.0]))
    for v in (0.05, 0.1, 0.5, 2.0, 100.0):
        h.observe(v)
    m = parse_prometheus(reg.render())
    buckets = {le: m[key("lat_seconds_bucket", le=le)] for le in ("0.1", "1.0", "10.0", "+Inf")}
    assert buckets == {"0.1": 2, "1.0": 3, "10.0": 4, "+Inf": 5}   # le: value <= bound
    assert m[key("lat_seconds_count")] == 5
    assert m[key("lat_seconds_sum")] == pytest.approx(102.65)


def test_labelled_histogram_and_unused_labels_render_nothing():
    reg = Registry()
    h = reg.register(Histogram("ttft", "TTFT", ["endpoint"], buckets=[1.0]))
    assert parse_prometheus(reg.render()) == {}
    h.labels("chat").observe(0.5)
    m = parse_prometheus(reg.render())
    assert m[key("ttft_bucket", endpoint="chat", le="1.0")] == 1
    assert m[key("ttft_count", endpoint="chat")] == 1


def test_label_values_are_escaped():
    reg = Registry()
    c = reg.register(Counter("odd_total", 'Help with \\ and\nnewline', ["v"]))
    nasty = 'a "quoted" \\ back\nslash'
    c.labels(nasty).inc()
    text = reg.render().decode()
    assert 'odd_total{v="a \\"quoted\\" \\\\ back\\nslash"} 1' in text
    assert "# HELP odd_total Help with \\\\ and\\nnewline" in text
    assert parse_prometheus(text) == {key("odd_total", v=nasty): 1.0}


def test_misuse_is_refused():
    reg = Registry()
    c = reg.register(Counter("x_total", "x", ["a"]))
    with pytest.raises(ValueError):
        c.labels("1", "2")
    with pytest.raises(ValueError):
        reg.register(Gauge("x_total", "again"))
    with pytest.raises(ValueError):
        Counter("y_total", "y").inc(-1)
    with pytest.raises(ValueError):
        parse_prometheus("not a metric line at all")


def test_server_metrics():
    sm = ServerMetrics()
    sm.request_done("/v1/completions", 200)
    sm.ttft.observe(0.02)
    sm.itl.observe(0.004)
    sm.e2e.observe(1.5)
    sm.queue.observe(0.0005)
    sm.prompt_tokens.inc(12)
    sm.generation_tokens.inc(30)
    sm.update_engine(SimpleNamespace(num_running=2, num_waiting=1, kv_blocks_used=25, kv_blocks_leased=4,
                                     kv_blocks_total=100, prefix_cache_queries=64,
                                     prefix_cache_hits=32, num_prefill_tokens=300))
    assert parse_prometheus(sm.render())[key("splitserve_requests_shed_total")] == 0
    sm.shed.inc()
    sm.engine_restarts.set_total(2)
    m = parse_prometheus(sm.render())
    assert m[key("splitserve_requests_total", endpoint="/v1/completions", status="200")] == 1
    assert m[key("splitserve_requests_shed_total")] == 1
    assert m[key("splitserve_engine_restarts_total")] == 2
    assert m[key("splitserve_time_to_first_token_seconds_bucket", le="0.025")] == 1
    assert m[key("splitserve_time_to_first_token_seconds_bucket", le="0.01")] == 0
    assert m[key("splitserve_request_queue_time_seconds_bucket", le="0.001")] == 1
    assert m[key("splitserve_e2e_request_latency_seconds_count")] == 1
    assert m[key("splitserve_inter_token_latency_seconds_sum")] == 0.004
    assert m[key("splitserve_num_requests_running")] == 2
    assert m[key("splitserve_num_requests_waiting")] == 1
    assert m[key("splitserve_num_prefill_tokens")] == 300
    assert m[key("splitserve_kv_blocks_used")] == 25 and m[key("splitserve_kv_blocks_total")] == 100
    assert m[key("splitserve_kv_cache_usage")] == 0.25
    assert m[key("splitserve_prompt_tokens_total")] == 12
    assert m[key("splitserve_generation_tokens_total")] == 30
    assert m[key("splitserve_prefix_cache_hits_total")] == 32
    buckets = [v for (name, labels), v in m.items()
               if name == "splitserve_inter_token_latency_seconds_bucket"]
    assert len(buckets) == 20 and buckets == sorted(buckets)
