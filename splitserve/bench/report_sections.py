"""The sections of `splitserve bench report` (report.py): each runs its steps, reads their
JSON and returns a `Section` of markdown; a step that fails becomes a failure on the page."""

from __future__ import annotations

import json
import os
import time

from splitserve.bench.metrics import latency_stats, server_deltas
from splitserve.bench.report import (LoadProbe, ReportConfig, Section, Service, StepFailed,
                                     commands, failed, free_port, git_commit, machine,
                                     machine_line, num, run_inprocess, run_step, scrape, stats,
                                     table, tool)

TARGET_PREFILL, TARGET_DECODE8 = 1500.0, 260.0
MIXED_SEED = 22       # full run: long prompts are requests 6 and 15 of 20; quick: 6 of 8
BACKGROUND = ("background: how many cores other processes on this shared VM kept busy "
              "during the step (/proc/stat minus the benchmark's own processes)")
STEP_ERRORS = (StepFailed, OSError, ValueError, KeyError)


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _first_line(exc: Exception) -> str:
    return f"failed: {str(exc).splitlines()[0]}"


def _plot(cfg: ReportConfig, paths: list[str], name: str) -> tuple[list[str], str]:
    """`splitserve bench plot` over result files: (its command, markdown images)."""
    if not paths:
        return [], "(no plots: no run succeeded)"
    cmd = tool("bench", "plot", *paths, "--out", cfg.img(name))
    try:
        out = run_inprocess(cmd)
    except StepFailed as exc:
        return [cmd], failed(exc)
    pngs = [line.strip() for line in out.splitlines() if line.strip().endswith(".png")]
    return [cmd], "\n\n".join(f"![{os.path.basename(p)}]({cfg.link(p)})" for p in pngs)


# -- 1. engine --------------------------------------------------------------------------------
ENGINE = "1. Engine: prefill and decode throughput"


def engine(cfg: ReportConfig) -> Section:
    configs = [("float32", ["--dtype", "float32"]), ("bfloat16", ["--dtype", "bfloat16"])]
    if "int8" in run_inprocess(tool("bench", "engine", "--help")).partition("--quantization")[2]:
        configs.append(("int8", ["--quantization", "int8"]))
    rows, cmds, results = [], [], {}
    for name, args in configs:
        path = cfg.result(f"engine-{name}.json")
        cmds.append(tool("bench", "engine", *cfg.model_args, *args, *_engine_load(cfg, name),
                         "--json", path))
        try:
            probe = LoadProbe()
            run_step(cmds[-1], 240 if cfg.quick else 600, cfg.result(f"logs/engine-{name}.log"))
            results[name] = r = {**_load(path), "background": probe.cores()}
        except STEP_ERRORS as exc:
            rows.append([name, _first_line(exc)] + [""] * 7)
            continue
        d, ms = r["decode_tok_s"], r["decode_ms_step"]
        rows.append([f"{name} ({r['dtype']} compute)",
                     f"{num(r['prefill_tok_s'])} ({r['prefill_len']} tokens)",
                     *(num(d.get(b)) for b in ("1", "8", "32")),
                     " / ".join(num(ms.get(b), 0) for b in ("1", "8", "32")),
                     _verdict(r["prefill_tok_s"], TARGET_PREFILL),
                     _verdict(d.get("8"), TARGET_DECODE8), num(r["background"])])
    scope = "" if cfg.model is None else " (they are for the bundled model, not this one)"
    body = "\n\n".join([
        f"Machine: {machine_line()}. `splitserve bench engine` times the engine alone, in "
        "one process with torch's default threads (all cores), no HTTP: prefill is one prompt "
        f"at a time; decode tok/s is the batch size over the median step time; {BACKGROUND}.",
        table(["configuration", "prefill tok/s", "decode tok/s b=1", "b=8", "b=32",
               "ms/step b=1 / 8 / 32", "prefill ≥ 1,500", "decode b=8 ≥ 260",
               "background (cores)"], rows),
        "Targets from the issue, which is what a widely used engine reaches with the same "
        f"model on this machine: decode at batch 8 ≥ 260 tok/s, prefill ≥ 1,500 tok/s{scope}.",
        _bf16_note(results), commands(cmds)])
    return Section(ENGINE, body, _engine_summary(results))


def _verdict(value, target: float) -> str:
    return "–" if value is None else ("**PASS**" if value >= target else "FAIL")


def _engine_load(cfg: ReportConfig, name: str) -> list[str]:
    """Bounded settings: bfloat16 without native support is ~10x slower, so fewer steps."""
    slow = name == "bfloat16" and not machine()["native_bf16"]
    if slow and cfg.quick:
        return ["--prefill-len", "64", "--repeats", "1", "--decode-steps", "2",
                "--decode-prompt-len", "8", "--batch-sizes", "1,8"]
    if slow or cfg.quick:
        return ["--prefill-len", "128", "--repeats", "1", "--decode-steps", "4",
                "--decode-prompt-len", "16", "--batch-sizes", "1,8,32"]
    return ["--prefill-len", "512", "--repeats", "2", "--decode-steps", "8",
            "--decode-prompt-len", "32", "--batch-sizes", "1,8,32"]


def _bf16_note(results: dict) -> str:
    fp32, bf16 = results.get("float32"), results.get("bfloat16")
    if not fp32 or not bf16 or not bf16["decode_tok_s"].get("8"):
        return ""
    slowdown = {"decode at batch 8": fp32["decode_tok_s"]["8"] / bf16["decode_tok_s"]["8"],
                "prefill": fp32["prefill_tok_s"] / bf16["prefill_tok_s"]}
    compare = ", ".join(f"{k} {x:.1f}× slower" if x > 1 else f"{k} {1 / x:.1f}× faster"
                        for k, x in slowdown.items())
    slower = [k for k, x in slowdown.items() if x > 1]
    if not slower:
        text = f"bfloat16 is faster than float32 here ({compare})."
    else:
        why = ("this CPU has AVX2 but neither AVX512-BF16 nor AMX, so PyTorch computes "
               "bfloat16 matmuls by converting to float32 in software: halving the bytes does "
               "not pay (`--dtype auto` picks float32 here)" if not machine()["native_bf16"]
               else "unexpected, as this CPU computes bfloat16 natively")
        text = (f"**bfloat16 is slower than float32 on this CPU** at {' and '.join(slower)} "
                f"(bfloat16 vs float32: {compare}); {why}. bfloat16 runs fewer, shorter steps "
                "to fit the time budget (see its command).")
    noisy = max(fp32["background"], bf16["background"])
    return text + (f" Other processes kept up to {noisy:.1f} cores busy during these runs, "
                   "which distorts the comparison." if noisy > 0.3 else "")


def _engine_summary(results: dict) -> str:
    ok = {k: r for k, r in results.items() if r["decode_tok_s"].get("8")}
    if not ok:
        return ""
    name, r = max(ok.items(), key=lambda kv: kv[1]["decode_tok_s"]["8"])
    pre, dec = r["prefill_tok_s"], r["decode_tok_s"]["8"]
    return (f"the engine's fastest configuration ({name}) prefills {num(pre, 0)} tok/s "
            f"({'PASS' if pre >= TARGET_PREFILL else 'FAIL'} against 1,500) and decodes "
            f"{num(dec, 0)} tok/s at batch 8 ({'PASS' if dec >= TARGET_DECODE8 else 'FAIL'} "
            "against 260)")


# -- 2. one worker ----------------------------------------------------------------------------
WORKER = "2. One worker: latency and throughput against concurrency"


def worker(cfg: ReportConfig) -> Section:
    n_in, n_out, duration = (64, 16, 30) if cfg.quick else (256, 64, 60)
    requests = {1: 3, 16: 16, 64: 64} if cfg.quick else {1: 6, 16: 16, 64: 64}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = _worker_cmd(cfg, port)
    rows, cmds, paths = [], [serve], []
    with Service(serve, url, cfg.result("logs/worker-server.log"), cfg.start_timeout) as svc:
        for c, n in requests.items():
            path = cfg.result(f"worker-c{c}.json")
            cmds.append(_bench_serve(url, f"worker-c{c}", path, "--workload", "random",
                                     "--input-len", n_in, "--output-len", n_out, "--concurrency",
                                     c, "--num-requests", n, "--duration", duration,
                                     "--warmup", 1 if cfg.quick else 2, "--timeout", 180))
            try:
                probe = LoadProbe(svc)
                run_step(cmds[-1], duration + 600, cfg.result(f"logs/worker-c{c}.log"))
                m = _load(path)["metrics"]
                paths.append(path)
            except STEP_ERRORS as exc:
                rows.append([c, _first_line(exc)] + [""] * 8)
                continue
            rows.append([c, f"{m['completed']} / {m['failed']}", num(m["request_throughput"], 2),
                         num(m["output_throughput"]), stats(m["ttft_ms"]), stats(m["tpot_ms"]),
                         stats(m["itl_ms"]), stats(m["e2e_ms"]), _errors(m),
                         num(probe.cores())])
    plot_cmd, plots = _plot(cfg, paths, "worker")
    body = "\n\n".join([
        f"One `splitserve serve` worker ({cfg.serve_dtype}, 2 threads) on "
        f"{cfg.model or 'the bundled model'}: streaming /v1/completions, random prompts of "
        f"{n_in} tokens, {n_out} output tokens each (ignore_eos), closed loop at each "
        "concurrency. Latencies in ms as p50 / p90 / p99 (definitions at the end); "
        f"{BACKGROUND}.", table(["concurrency", "ok / failed", "req/s", "output tok/s", "TTFT",
                                 "TPOT", "ITL", "E2E", "errors", "background (cores)"], rows),
        plots, commands(cmds + plot_cmd)])
    c16 = cfg.result("worker-c16.json")
    if c16 not in paths:
        return Section(WORKER, body)
    m = _load(c16)["metrics"]
    return Section(WORKER, body, f"one worker at concurrency 16 serves "
                   f"{num(m['request_throughput'], 2)} req/s and {num(m['output_throughput'], 0)}"
                   f" output tok/s with TTFT p50 {num(m['ttft_ms']['p50'], 0)} ms and ITL p50 "
                   f"{num(m['itl_ms']['p50'], 0)} ms")


def _bench_serve(url: str, label: str, path: str, *load) -> list[str]:
    return tool("bench", "serve", "--url", url, *(str(a) for a in load), "--label", label,
                "--json", path, "--no-progress")


def _worker_cmd(cfg: ReportConfig, port: int) -> list[str]:
    """One aggregated worker on both cores."""
    return tool("serve", *cfg.model_args, "--dtype", cfg.serve_dtype, "--threads", "2",
                "--kv-cache-gib", "2", "--port", str(port))


def _errors(m: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in m["errors"].items()) or "none"


# -- 3. aggregated vs disaggregated -----------------------------------------------------------
DISAGG = "3. Aggregated vs disaggregated: short chats while long prompts prefill"


def disagg(cfg: ReportConfig) -> Section:
    rate, n, duration, n_in, n_out, frac, lo, hi = (
        (2.0, 8, 30, 64, 16, 0.25, 1000, 2000) if cfg.quick else
        (0.2, 20, 100, 64, 32, 0.1, 2000, 4000))
    targets = {"agg-mixed": "aggregated: 1 worker, 2 threads",
               "disagg-mixed": "disaggregated: 1 CTX + 1 GEN, 1 thread each"}
    results, cmds, notes, gen, background = {}, [], [], None, {}
    for label, name in targets.items():
        port = free_port(3)
        gen_url = f"http://127.0.0.1:{port + 2}" if label == "disagg-mixed" else None
        serve = _worker_cmd(cfg, port) if gen_url is None else tool(    # `up --port P`: CTX on
            "up", *cfg.model_args, "--dtype", cfg.serve_dtype, "--threads", "1",  # P+1, GEN P+2
            "--port", str(port))
        url, path = f"http://127.0.0.1:{port}", cfg.result(f"{label}.json")
        cmds += [serve, _bench_serve(
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
            results[label] = _load(path)
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
                     num(m["request_throughput"], 2), num(m["output_throughput"]), _errors(m),
                     num(background.get(label))])
    plot_cmd, plots = _plot(cfg, [cfg.result(f"{k}.json") for k in results], "disagg")
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


# -- 4. the GEN front-end ---------------------------------------------------------------------
FRONTEND = "4. Token relay: the GEN front-end's cost per relay mode"


def frontend(cfg: ReportConfig) -> Section:
    try:
        run_inprocess(tool("bench", "frontend", "--help"))
    except StepFailed as exc:
        return Section(FRONTEND, "`splitserve bench frontend` is missing in this checkout, so "
                       f"this section has no numbers yet:\n\n```\n{exc}\n```",
                       "the token relay benchmark (`bench frontend`) is missing")
    path, png = cfg.result("frontend.json"), cfg.img("frontend.png")
    grid = ["--quick"] if cfg.quick else ["--duration", "3"]
    cmd = tool("bench", "frontend", *grid, "--json", path, "--plot", png, "--no-progress",
               *cfg.frontend_args)
    out = run_step(cmd, 600 if cfg.quick else 1200, cfg.result("logs/frontend.log"))
    result = _load(path)
    targets = result.get("targets", [])
    rows = [[t["name"], num(t.get("value"), 3), f"≤ {t['bound']:.3g}",
             {True: "**PASS**", False: "FAIL"}.get(t.get("pass"), "n/a")] for t in targets]
    printed = "\n".join(ln for ln in out.splitlines() if not ln.startswith(("results:", "plot:")))
    body = "\n\n".join([
        "`splitserve bench frontend` sends generation_only requests straight to one GEN "
        "worker (tiny-random, with its KV pull skipped on purpose) with the prompt relayed as "
        "a JSON list, as base64 int32, or as metadata only (its length), and reads the "
        "worker's own CPU time and `gen_preprocessing` histogram (X-Sent-At → engine "
        "admission).", table(["target", "measured", "bound", "result"], rows),
        f"The tool's own table:\n\n```\n{printed.strip()}\n```",
        f"![frontend.png]({cfg.link(png)})" if os.path.exists(png) else "", commands([cmd])])
    passed = sum(t.get("pass") is True for t in targets)
    return Section(FRONTEND, body, f"the token relay meets {passed} of {len(targets)} "
                   "GEN front-end targets")


# -- the page's frame -------------------------------------------------------------------------
SECTIONS = ((ENGINE, engine), (WORKER, worker), (DISAGG, disagg), (FRONTEND, frontend))


def header(cfg: ReportConfig, sections: list[Section], background: float) -> str:
    clauses = [s.summary for s in sections if s.summary]
    summary = "; ".join(clauses) + "." if clauses else "no step produced numbers."
    model = cfg.model or "the bundled SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)"
    return (f"# Benchmarks\n\nGenerated by `{cfg.command}` on {time.strftime('%Y-%m-%d %H:%M %Z')}"
            f" from commit {git_commit()}.\n\n- Machine: {machine_line()}.\n- Model: {model}; "
            f"served workers run {cfg.serve_dtype}.\n\n**Summary.** {summary[0].upper()}"
            f"{summary[1:]} The machine is a small VM shared with other jobs: other processes "
            f"kept {background:.1f} of its {machine()['nproc']} cores busy on average during "
            "this run (each table says how many during each step), so absolute numbers are "
            "noisy; ratios carry over better.\n")


def howto(cfg: ReportConfig, elapsed: float) -> Section:
    try:
        explain = run_inprocess(tool("bench", "serve", "--explain")).strip()
    except StepFailed as exc:
        explain = f"(`splitserve bench serve --explain` failed: {exc})"
    return Section("5. How to regenerate", "\n\n".join([
        "```bash\nbash scripts/benchmarks.sh            # runs: splitserve bench report\n"
        "bash scripts/benchmarks.sh --quick    # ~2 min smoke test, written under "
        "bench-results/quick/\n```",
        f"This page was written by `{cfg.command}` in {elapsed / 60:.1f} min on the machine "
        "above (the full report is meant to take at most about 15 min on 2 cores). Each "
        f"step's JSON is kept under `{cfg.results_dir}/`, its output under "
        f"`{cfg.results_dir}/logs/`, the plots under `{cfg.img_dir}/`; every step's command "
        "is cited in its section, so any number can be reproduced on its own.",
        "Metric definitions, as `splitserve bench serve --explain` prints them "
        f"(splitserve/bench/metrics.py):\n\n```\n{explain}\n```"]))
