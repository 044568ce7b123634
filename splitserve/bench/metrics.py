"""Client-side serving metrics of `splitserve bench serve`, as vLLM's benchmark_serving and
NVIDIA genai-perf / AIPerf define them. Times are measured on the client with a monotonic
clock; every latency statistic is mean, p50, p90, p99 and max in milliseconds.

TTFT   time to first token: from just before the request is sent to the arrival of the first
       chunk whose content is not empty (the role-only first chat chunk and empty text
       chunks do not count). Streaming only.
TPOT   time per output token, one value per request: (E2E - TTFT) / (output_tokens - 1).
       Requests with a single output token have none. Streaming only.
ITL    inter-token latency: the gaps between consecutive non-empty content chunks of a
       request, pooled over all requests. A chunk may carry several tokens (the server holds
       back incomplete characters), so ITL and TPOT can differ. Streaming only.
E2E    end-to-end latency: from just before the request is sent to the end of the response
       (the `data: [DONE]` event when streaming, the whole body otherwise).

duration          first request sent -> last response ended (warm-up requests excluded)
request/s         successful requests / duration
input tok/s       prompt tokens of successful requests / duration; prompt tokens are the
                  server's usage.prompt_tokens, or the requested input length if it sends none
output tok/s      output tokens of successful requests / duration; usage.completion_tokens,
                  or the number of content chunks (streaming) / max_tokens (not streaming)
goodput           successful requests meeting every SLO bound / duration (DistServe's
                  definition, as vLLM's --goodput computes it). Bounds: --goodput
                  ttft:MS tpot:MS itl:MS e2el:MS (vLLM's form, milliseconds) or --slo
                  ttft=S,tpot=S,itl=S,e2e=S (seconds); itl bounds every gap of the request
                  (its largest), tpot its mean

A request that fails is an error, never a fast request: it is left out of every latency
statistic and of the token counts, and counted under its kind:
  http_<code>        the server answered with a status other than 200
  connection         could not connect, or the connection broke (also mid-stream)
  timeout            no complete response within --timeout
  invalid_response   a body or event that is not the expected JSON
  error_event        the server reported an error inside a 200 response (an SSE error event)
  incomplete_stream  the stream ended without `data: [DONE]`
  empty_response     the response carried no output token
"""

from __future__ import annotations

from collections import Counter

import msgspec
import numpy as np

from splitserve.prometheus import bucket_quantile

SLO_KEYS = ("ttft", "tpot", "itl", "e2e")
GOODPUT_KEYS = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2el": "e2e"}   # vLLM's names


class RequestRecord(msgspec.Struct, kw_only=True):
    """One measured request. Times in seconds; `start` is relative to the run's start."""
    cls: str = "default"
    conversation: int = 0
    turn: int = 0
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = []
    input_len: int = 0                   # requested
    max_tokens: int = 0                  # requested
    prompt_tokens: int | None = None     # usage, else the requested input length
    output_tokens: int | None = None     # usage, else counted chunks / max_tokens
    usage: bool = False                  # token counts come from the server's usage
    error: str | None = None             # kind (see the module docstring), None on success
    detail: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or (self.output_tokens or 0) < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=0.5,tpot=0.05' -> {'ttft': 0.5, 'tpot': 0.05} (seconds)."""
    slo = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo takes key=seconds pairs with keys {SLO_KEYS}, got {item!r}")
        slo[key] = float(value)
    return slo


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] (vLLM's --goodput, milliseconds) -> {'ttft': 0.5, 'tpot': 0.05}
    (seconds, as parse_slo)."""
    slo = {}
    for item in items or ():
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        try:
            ms = float(value)
        except ValueError:
            ms = float("nan")
        if not sep or key not in GOODPUT_KEYS or not ms > 0:
            raise ValueError(f"--goodput takes KEY:MS pairs with keys {tuple(GOODPUT_KEYS)} and "
                             f"a positive number of milliseconds, got {item!r}")
        slo[GOODPUT_KEYS[key]] = ms / 1000
    return slo


def latency_stats(seconds) -> dict:
    """count, mean, p50, p90, p99, max in ms; null values when there is no sample."""
    ms = np.asarray(list(seconds), dtype=np.float64) * 1000.0
    if ms.size == 0:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"count": int(ms.size), "mean": float(ms.mean()), "p50": float(p50),
            "p90": float(p90), "p99": float(p99), "max": float(ms.max())}


def meets_slo(rec: RequestRecord, slo: dict[str, float]) -> bool:
    values = {"ttft": rec.ttft, "tpot": rec.tpot, "itl": max(rec.itl, default=None),
              "e2e": rec.e2e}
    # tpot and itl are None for one-token outputs: there is nothing to violate.
    return all(values[k] is None or values[k] <= bound for k, bound in slo.items())


def summarize(records: list[RequestRecord], duration: float, slo: dict[str, float]) -> dict:
    ok = [r for r in records if r.error is None]
    rate = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    good = sum(meets_slo(r, slo) for r in ok) if slo else None
    return {
        "completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": rate(len(ok)), "input_throughput": rate(input_tokens),
        "output_throughput": rate(output_tokens),
        "goodput": None if good is None else rate(good), "slo": slo,
        "ttft_ms": latency_stats(r.ttft for r in ok if r.ttft is not None),
        "tpot_ms": latency_stats(r.tpot for r in ok if r.tpot is not None),
        "itl_ms": latency_stats(gap for r in ok for gap in r.itl),
        "e2e_ms": latency_stats(r.e2e for r in ok),
        "errors": dict(Counter(r.error for r in records if r.error is not None)),
    }


def summarize_by_class(records: list[RequestRecord], duration: float,
                       slo: dict[str, float]) -> dict[str, dict]:
    """Per-class summaries (rates over the whole run's duration); {} for one class."""
    classes = sorted({r.cls for r in records})
    if len(classes) < 2:
        return {}
    return {c: summarize([r for r in records if r.cls == c], duration, slo) for c in classes}


# -- server-side deltas from /metrics ---------------------------------------------------------
def _key(name: str, labels: frozenset) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels) if k != "le")
    return f"{name}{{{inner}}}" if inner else name


def server_deltas(before: dict, after: dict) -> dict:
    """Deltas of every `*_seconds` histogram and `*_total` counter between two scrapes
    (`parse_prometheus` output), so new stage histograms show up without code changes."""
    hist: dict[str, dict] = {}
    counters = {}
    for (name, labels), value in after.items():
        delta = value - before.get((name, labels), 0.0)
        if name.endswith("_seconds_bucket"):
            h = hist.setdefault(_key(name[:-len("_bucket")], labels), {"buckets": []})
            h["buckets"].append((float(dict(labels)["le"]), delta))
        elif name.endswith(("_seconds_count", "_seconds_sum")):
            base, _, field = name.rpartition("_")
            hist.setdefault(_key(base, labels), {"buckets": []})[field] = delta
        elif name.endswith("_total"):
            counters[_key(name, labels)] = delta
    return {"histograms": {k: _histogram_summary(h) for k, h in sorted(hist.items())},
            "counters": dict(sorted(counters.items()))}


def _histogram_summary(h: dict) -> dict:
    count, total = h.get("count", 0.0), h.get("sum", 0.0)
    buckets = sorted(h["buckets"])
    return {"count": int(count), "sum_s": total, "mean_ms": 1000 * total / count if count else None,
            "p50_ms": bucket_quantile(0.5, buckets), "p99_ms": bucket_quantile(0.99, buckets)}


# -- the human table ---------------------------------------------------------------------------
def format_table(result: dict) -> str:
    """A short text report of one result document (`splitserve bench serve` output)."""
    t, load, wl = result["target"], result["load"], result["workload"]
    shape = (f"concurrency {load['concurrency']}" if load["concurrency"] is not None
             else f"rate {load['request_rate']:g}/s (burstiness {load['burstiness']:g})")
    lines = [f"== {result['label']}: {t['model']} @ {t['url']}  {t['endpoint']}, "
             f"{'stream' if t['stream'] else 'no stream'}, {shape}, workload {wl['kind']} "
             f"(input {wl['input_len']}, output {wl['output_len']})"]
    lines += _summary_lines(result["metrics"])
    for cls, summary in result["metrics_by_class"].items():
        lines += [f"-- class {cls}:"] + _summary_lines(summary)
    lines += _server_lines(result["server"])
    return "\n".join(lines)


def _summary_lines(s: dict) -> list[str]:
    goodput = "" if s["goodput"] is None else f", goodput {s['goodput']:.2f} req/s"
    lines = [f"{s['completed']} ok, {s['failed']} failed in {s['duration_s']:.2f} s: "
             f"{s['request_throughput']:.2f} req/s, {s['input_throughput']:.1f} input tok/s, "
             f"{s['output_throughput']:.1f} output tok/s{goodput}",
             f"{'(ms)':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}{'n':>8}"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        st = s[f"{name}_ms"]
        cells = "".join(f"{st[k]:>10.2f}" if st[k] is not None else f"{'-':>10}"
                        for k in ("mean", "p50", "p90", "p99", "max"))
        lines.append(f"{name.upper():<6}{cells}{st['count']:>8}")
    errors = ", ".join(f"{k} {v}" for k, v in sorted(s["errors"].items())) or "none"
    return lines + [f"errors: {errors}"]


def _server_lines(server: dict) -> list[str]:
    if not server["available"]:
        return [f"server metrics: unavailable ({server['reason']})"]
    lines = [f"{'server /metrics deltas':<54}{'count':>8}"
             f"{'mean ms':>10}{'~p50 ms':>10}{'~p99 ms':>10}"]
    for name, h in server["histograms"].items():
        if h["count"]:
            cells = "".join(f"{h[k]:>10.2f}" if h[k] is not None else f"{'-':>10}"
                            for k in ("mean_ms", "p50_ms", "p99_ms"))
            lines.append(f"  {name:<52}{h['count']:>8}{cells}")
    lines += [f"  {name} +{value:g}" for name, value in server["counters"].items() if value]
    return lines
