"""What `splitserve bench frontend` makes of its runs: each run's row from the worker's
/metrics, the issue's targets, the printed table and the plot."""

from __future__ import annotations

import os

import numpy as np

from splitserve.bench.frontend.client import RunSpec
from splitserve.bench.frontend.config import MODES, BenchError
from splitserve.bench.metrics import latency_stats, server_deltas
from splitserve.prometheus import parse_prometheus

GEN_PRE = "splitserve_gen_preprocessing_seconds"
QUEUE = "splitserve_request_queue_time_seconds"


# -- one run, from the worker's point of view -------------------------------------------------
def summarize_run(spec: RunSpec, out: dict, engine_cpu: float | None = None) -> dict:
    """The run's row; BenchError when any request failed or the worker miscounted.
    engine_cpu: CPU seconds of the engine process over the run, when known."""
    where = f"{spec.mode} ISL {spec.isl} concurrency {spec.concurrency}"
    if out["num_failed"]:
        raise BenchError(f"{where}: {out['num_failed']} requests failed, e.g. "
                         + " | ".join(out["failures"]))
    done = len(out["latencies_s"])
    server = server_deltas(parse_prometheus(out["metrics_before"]),
                           parse_prometheus(out["metrics_after"]))
    counters, hists = server["counters"], server["histograms"]
    relayed = counters.get(f'splitserve_token_relay_total{{mode="{spec.mode}"}}', 0)
    if done == 0 or relayed != done or hists[GEN_PRE]["count"] != done:
        raise BenchError(f"{where}: {done} answers, but the worker counted {relayed:g} "
                         f"{spec.mode} relays and {hists[GEN_PRE]['count']} admissions")
    cpu = counters["process_cpu_seconds_total"]
    return {"mode": spec.mode, "isl": spec.isl, "concurrency": spec.concurrency,
            "max_tokens": spec.max_tokens, "think_time_s": spec.think_time,
            "requests": spec.num_requests, "completed": done, "errors": 0,
            "truncated_by_duration": done < spec.num_requests, "duration_s": out["duration_s"],
            "request_throughput": done / out["duration_s"], "body_bytes": out["body_bytes"],
            "mean_in_flight": out["in_flight"],   # past the ramp, before the deadline
            "server_cpu_s": cpu, "server_cpu_per_request_us": 1e6 * cpu / done,
            "engine_cpu_per_request_us": None if engine_cpu is None else 1e6 * engine_cpu / done,
            "client_cpu_per_request_us": 1e6 * out["client_cpu_s"] / done,
            "gen_preprocessing_ms": _hist(hists[GEN_PRE]), "queue_ms": _hist(hists[QUEUE]),
            "client_latency_ms": latency_stats(out["latencies_s"])}


def _hist(h: dict) -> dict:
    return {k: h[k] for k in ("count", "mean_ms", "p50_ms", "p99_ms")}


# -- targets ----------------------------------------------------------------------------------
def _cell(runs: list[dict], mode: str, isl: int, c: int) -> dict | None:
    return next((r for r in runs if (r["mode"], r["isl"], r["concurrency"]) == (mode, isl, c)), None)


def _nearest(values, want: int) -> int:
    return want if want in values else max(values)


def _ratio_target(runs, name, num, den, isl_num, isl_den, bound) -> dict:
    """max over the grid's concurrencies of cpu/request (num at isl_num) / (den at isl_den)."""
    ratios = {}
    for c in sorted({r["concurrency"] for r in runs}):
        a, b = _cell(runs, num, isl_num, c), _cell(runs, den, isl_den, c)
        if a and b:
            ratios[c] = a["server_cpu_per_request_us"] / b["server_cpu_per_request_us"]
    worst = max(ratios.values()) if ratios else None
    return {"name": name, "bound": bound, "value": worst, "by_concurrency": ratios,
            "pass": None if worst is None else worst <= bound}


def evaluate_targets(runs: list[dict]) -> list[dict]:
    """The issue's targets, each at the grid's value nearest to the one it names."""
    isls = {r["isl"] for r in runs}
    mid, lo, hi = _nearest(isls, 32768), min(isls), _nearest(isls, 131072)
    c_hi = _nearest({r["concurrency"] for r in runs}, 1024)
    # The p99 bound is about a loaded GEN: requests held decoding while new ones arrive. A
    # closed loop of one-token requests is saturated by construction (Little's law puts
    # concurrency / throughput in front of the loop); it is the load only if no held run is.
    held = [r for r in runs if r.get("max_tokens", 1) > 1]
    if not held:
        load = f"concurrency {c_hi}, closed loop of one-token requests"
    else:
        load = f"{held[0]['concurrency']} requests held decoding"
        if held[0].get("think_time_s"):
            load += f", think time {held[0]['think_time_s']:g} s"
    targets = [
        _ratio_target(runs, f"server CPU/request b64 / list at ISL {mid}", "b64", "list",
                      mid, mid, 1 / 5),
        _ratio_target(runs, f"server CPU/request metadata / list at ISL {mid}", "metadata",
                      "list", mid, mid, 1 / 20),
        _ratio_target(runs, f"server CPU/request metadata ISL {hi} / ISL {lo}", "metadata",
                      "metadata", hi, lo, 1.5)]
    p99 = {r["isl"]: r["gen_preprocessing_ms"]["p99_ms"] for r in (held or runs)
           if r["mode"] == "metadata" and r["concurrency"] == c_hi}
    worst = max(p99.values()) if p99 else None
    targets.append({"name": f"gen_preprocessing p99 (ms), metadata, {load}",
                    "bound": 10.0, "value": worst, "by_isl": p99,
                    "pass": None if worst is None else worst <= 10.0})
    return targets


# -- report -----------------------------------------------------------------------------------
def format_table(runs: list[dict]) -> str:
    lines = ["fe# = the worker's front-end processes. "
             "CPU in us per request: fe = the worker's front-end (the measured cost), eng = its "
             "engine process, cli = the client; fe% = front-end CPU / wall time; infl = mean "
             "requests in flight at the worker (sent, not yet answered) after the ramp-up and "
             "before --duration ends. Latencies in "
             "ms: pre = gen_preprocessing (X-Sent-At -> engine admission), queue = admission -> "
             "KV blocks (server percentiles interpolated in histogram buckets), lat = client. "
             "* = stopped by --duration",
             f"{'fe#':<4}{'mode':<9}{'ISL':>7}{'conc':>6}{'infl':>6}{'ok':>6}{'req/s':>7}{'fe':>7}"
             f"{'eng':>7}{'cli':>7}"
             f"{'fe%':>5}{'pre p50':>9}{'pre p99':>9}{'queue p99':>10}{'lat p50':>9}{'lat p99':>9}"
             f"{'KiB':>6}"]
    for r in runs:
        g, q, lat = r["gen_preprocessing_ms"], r["queue_ms"], r["client_latency_ms"]
        eng = r["engine_cpu_per_request_us"]
        ok = f"{r['completed']}{'*' if r['truncated_by_duration'] else ''}"
        # The queue histogram's first bucket is 1 ms.
        queue = "<1" if (q["p99_ms"] or 0) <= 1.0 else format_ms(q["p99_ms"])
        lines.append(f"{r.get('frontends', 1):<4}{r['mode']:<9}{r['isl']:>7}{r['concurrency']:>6}"
                     f"{r['mean_in_flight']:>6.0f}{ok:>6}"
                     f"{r['request_throughput']:>7.0f}{r['server_cpu_per_request_us']:>7.0f}"
                     f"{'-' if eng is None else f'{eng:.0f}':>7}"
                     f"{r['client_cpu_per_request_us']:>7.0f}"
                     f"{100 * r['server_cpu_s'] / r['duration_s']:>5.0f}"
                     f"{format_ms(g['p50_ms']):>9}{format_ms(g['p99_ms']):>9}{queue:>10}"
                     f"{format_ms(lat['p50']):>9}{format_ms(lat['p99']):>9}"
                     f"{r['body_bytes'] / 1024:>6.0f}")
    return "\n".join(lines)


def format_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}" if v < 1 else f"{v:.1f}"


def format_targets(targets: list[dict]) -> str:
    lines = []
    for t in targets:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[t["pass"]]
        value = "not measured" if t["value"] is None else f"{t['value']:.3g}"
        detail = t.get("by_concurrency") or t.get("by_isl") or {}
        each = ", ".join(f"{k}: {v:.3g}" for k, v in detail.items())
        lines.append(f"{verdict}  {t['name']}: {value} (target <= {t['bound']:.3g}; {each})")
    return "\n".join(lines)


def plot(runs: list[dict], path: str) -> str:
    """gen_preprocessing p50 (solid) and p99 (dashed) against concurrency, log-log: one
    panel per ISL, one line per mode."""
    from splitserve.bench.plot import _pyplot
    plt = _pyplot()
    isls = sorted({r["isl"] for r in runs})
    fig, axes = plt.subplots(1, len(isls), figsize=(3.6 * len(isls) + 1, 4.2), sharey=True,
                             squeeze=False)
    for ax, isl in zip(axes[0], isls):
        for i, mode in enumerate(MODES):
            cells = sorted((r for r in runs if r["mode"] == mode and r["isl"] == isl),
                           key=lambda r: r["concurrency"])
            x = [r["concurrency"] for r in cells]
            for q, style in (("p50_ms", "-"), ("p99_ms", "--")):
                y = [r["gen_preprocessing_ms"][q] or np.nan for r in cells]
                ax.plot(x, y, style, marker="o", color=f"C{i}",
                        label=mode if cells and q == "p50_ms" else None)
        ticks = sorted({r["concurrency"] for r in runs})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ticks, [str(c) for c in ticks])
        ax.set(title=f"ISL {isl}", xlabel="concurrency")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("gen_preprocessing (ms)")
    axes[0][-1].legend(fontsize="small")
    fig.suptitle("GEN front-end: X-Sent-At -> engine admission, per token relay mode "
                 "(p50 solid, p99 dashed)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
