"""A section of `splitserve bench report`: one aggregated worker against a CTX + GEN pair on
the same open-loop mixed workload, short chats while long prompts prefill."""

from __future__ import annotations

import json

from splitserve.bench.metrics import latency_stats, server_deltas
from splitserve.bench.report.config import ReportConfig
from splitserve.bench.report.machine import LoadProbe
from splitserve.bench.report.markdown import Section, commands, failed, num, stats, table
from splitserve.bench.report.steps import (STEP_ERRORS, Service, load_json, plot_step,
                                           run_step, scrape, tool)
from splitserve.bench.report.worker import bench_serve_cmd, error_counts, worker_cmd
from splitserve.bench.server_process import free_port

MIXED_SEED = 22       # full run: long prompts are requests 6 and 15 of 20; quick: 6 of 8
DISAGG = "Aggregated vs disaggregated: short chats while long prompts prefill"


def disagg(cfg: ReportConfig) -> Section:
    rate, n, duration, n_in, n_out, frac, lo, hi = (
        (2.0, 8, 30, 64, 16, 0.25, 1000, 2000) if cfg.quick else
        (0.2, 20, 100, 64, 32, 0.1, 2000, 4000))
    targets = {"agg-mixed": "aggregated: 1 worker, default placement",
               "disagg-mixed": "disaggregated: 1 CTX + 1 GEN, default placement"}
    results, cmds, notes, gen, background = {}, [], [], None, {}
    for label, name in targets.items():
        port = free_port(3)
        gen_url = f"http://127.0.0.1:{port + 2}" if label == "disagg-mixed" else None
        serve = worker_cmd(cfg, port) if gen_url is None else tool(    # `up --port P`: CTX on
            "up", *cfg.model_args, "--dtype", cfg.serve_dtype, "--port", str(port))  # P+1, P+2
        url, path = f"http://127.0.0.1:{port}", cfg.result(f"{label}.json")
        cmds += [serve, bench_serve_cmd(
            url, label, path, "--workload", "mixed", "--input-len", n_in, "--output-len", n_out,
            "--long-fraction", frac, "--long-len-min", lo, "--long-len-max", hi,
            "--request-rate", rate, "--num-requests", n, "--duration", duration,
            "--seed", MIXED_SEED, "--warmup", 1, "--timeout", 300)]
        try:
            with Service(serve, url, cfg.result(f"logs/{label}-server.log"),
                         cfg.start_timeout) as svc:
                before, probe = scrape(gen_url) if gen_url else None, LoadProbe(svc)
                run_step(cmds[-1], duration + 600, cfg.result(f"logs/{label}.log"))
                background[label] = probe.cores()
                if gen_url:
                    gen = server_deltas(before, scrape(gen_url))
                    with open(cfg.result(f"{label}-gen-server.json"), "w") as f:
                        json.dump(gen, f, indent=1)
            results[label] = load_json(path)
        except STEP_ERRORS as exc:
            notes.append(f"{name}: {failed(exc)}")
    latency, tput = [], []
    for label, r in results.items():
        m, by = r["metrics"], r["metrics_by_class"]
        short, long_ = by.get("short", m), by.get("long", {})
        busy_ttft, busy_itl = during_long_prefill(r["requests"])
        latency.append([targets[label], stats(short["ttft_ms"], ("p50", "p99")),
                        stats(short["itl_ms"], ("p50", "p99")),
                        f"{stats(busy_ttft, ('p50', 'p99'))} (n={busy_ttft['count']})",
                        f"{stats(busy_itl, ('p50', 'p99'))} (n={busy_itl['count']})",
                        stats(long_.get("ttft_ms", {}), ("p50", "max"))])
        tput.append([targets[label], f"{m['completed']} / {m['failed']}",
                     long_.get("completed", 0), num(m["duration_s"]),
                     num(m["request_throughput"], 2), num(m["output_throughput"]), error_counts(m),
                     num(background.get(label))])
    plot_cmd, plots = plot_step(cfg, [cfg.result(f"{k}.json") for k in results], "disagg")
    body = "\n\n".join([
        f"The same open-loop `mixed` workload (seed {MIXED_SEED}) against both targets: chat "
        f"requests arriving at {rate:g}/s (Poisson), short prompts of {n_in} words and, with "
        f"probability {frac:g}, a long prompt of {lo:,}–{hi:,} words; {n_out} output tokens "
        f"each, {n} requests. Latencies in ms. \"While a long prompt prefills\" keeps the "
        "short requests' waits for a first token, and the gaps between their tokens, that "
        "overlap a long request's arrival → first token window.", *notes,
        table(["target", "short TTFT p50 / p99", "short ITL p50 / p99", "short TTFT while a "
               "long prompt prefills", "short ITL while a long prompt prefills",
               "long TTFT p50 / max"], latency),
        table(["target", "ok / failed", "long ok", "duration s", "req/s", "output tok/s",
               "errors", "background (cores)"], tput), _throughput_note(results, rate),
        "Server-side stages of the disaggregated run: the orchestrator's histograms from the "
        "`server` section of its JSON, and the GEN worker's /metrics scraped before and after "
        "the run (so they include its warm-up request). Quantiles are interpolated within "
        "histogram buckets.", _stages(results.get("disagg-mixed"), gen), plots,
        commands(cmds + plot_cmd)])
    return Section(DISAGG, body, _disagg_summary(results))


def during_long_prefill(requests: list[dict]) -> tuple[dict, dict]:
    """latency_stats of the short requests' TTFTs and ITL gaps that overlap some long
    request's arrival -> first token window (its queueing and prefill)."""
    ok = [r for r in requests if r["error"] is None and r["ttft"] is not None]
    windows = [(r["start"], r["start"] + r["ttft"]) for r in ok if r["cls"] == "long"]

    def busy(a: float, b: float) -> bool:
        return any(a < end and b > start for start, end in windows)
    ttft, itl = [], []
    for r in (r for r in ok if r["cls"] == "short"):
        t = r["start"] + r["ttft"]
        if busy(r["start"], t):
            ttft.append(r["ttft"])
        for gap in r["itl"]:
            if busy(t, t + gap):
                itl.append(gap)
            t += gap
    return latency_stats(ttft), latency_stats(itl)


def _throughput_note(results: dict, rate: float) -> str:
    if len(results) < 2:
        return ""
    agg, dis = (results[k]["metrics"]["output_throughput"] for k in ("agg-mixed", "disagg-mixed"))
    text = (f"Throughput: both runs are offered the same {rate:g} req/s, so req/s mostly "
            f"follows the offered load; the disaggregated pair delivered {dis / agg:.0%} of the "
            "aggregated worker's output tok/s. ")
    if dis >= agg:
        return text + ("Splitting cost no throughput in this run: neither target was "
                       "saturated, and the aggregated worker drained its queue more slowly.")
    return text + ("The cost of splitting 2 cores is capacity: each stage gets one thread, so "
                   "a long prompt prefills on one core instead of two (see the long TTFT), "
                   "and the CTX core idles whenever nothing needs prefilling.")


def _stages(result: dict | None, gen: dict | None) -> str:
    rows = [[process, f"`{key.removeprefix('splitserve_').removesuffix('_seconds')}`",
             h["count"], num(h["mean_ms"]), num(h["p50_ms"]), num(h["p99_ms"])]
            for process, server in (("orchestrator", (result or {}).get("server")), ("GEN", gen))
            for key, h in (server or {}).get("histograms", {}).items() if h["count"]]
    return (table(["process", "stage", "count", "mean ms", "~p50 ms", "~p99 ms"], rows) if rows
            else "(no server-side histograms: the disaggregated run failed)")


def _disagg_summary(results: dict) -> str:
    if len(results) < 2:
        return ""
    a, d = results["agg-mixed"], results["disagg-mixed"]
    (_, ia), (_, id_) = during_long_prefill(a["requests"]), during_long_prefill(d["requests"])
    sa, sd = (r["metrics_by_class"].get("short", r["metrics"])["ttft_ms"] for r in (a, d))
    return (f"on a mixed workload, short requests' ITL p99 while long prompts prefill is "
            f"{num(ia['p99'], 0)} ms aggregated vs {num(id_['p99'], 0)} ms disaggregated "
            f"(short TTFT p50 {num(sa['p50'], 0)} vs {num(sd['p50'], 0)} ms), at "
            f"{num(a['metrics']['output_throughput'])} vs "
            f"{num(d['metrics']['output_throughput'])} output tok/s")
