"""A section of `splitserve bench report`: one `splitserve serve` worker under closed-loop
`bench serve` load at a few concurrencies; also the worker and load commands the disaggregated
section uses."""

from __future__ import annotations

from splitserve.bench.report.config import ReportConfig
from splitserve.bench.report.machine import BACKGROUND, LoadProbe
from splitserve.bench.report.markdown import Section, commands, failed_cell, num, stats, table
from splitserve.bench.report.steps import (STEP_ERRORS, Service, load_json, plot_step,
                                           run_step, tool)
from splitserve.bench.server_process import free_port

WORKER = "One worker: latency and throughput against concurrency"


def worker(cfg: ReportConfig) -> Section:
    n_in, n_out, duration = (64, 16, 30) if cfg.quick else (256, 64, 60)
    requests = {1: 3, 16: 16, 64: 64} if cfg.quick else {1: 6, 16: 16, 64: 64}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = worker_cmd(cfg, port)
    rows, cmds, paths = [], [serve], []
    with Service(serve, url, cfg.result("logs/worker-server.log"), cfg.start_timeout) as svc:
        for c, n in requests.items():
            path = cfg.result(f"worker-c{c}.json")
            cmds.append(bench_serve_cmd(url, f"worker-c{c}", path, "--workload", "random",
                                        "--input-len", n_in, "--output-len", n_out,
                                        "--concurrency", c, "--num-requests", n,
                                        "--duration", duration,
                                        "--warmup", 1 if cfg.quick else 2, "--timeout", 180))
            try:
                probe = LoadProbe(svc)
                run_step(cmds[-1], duration + 600, cfg.result(f"logs/worker-c{c}.log"))
                m = load_json(path)["metrics"]
                paths.append(path)
            except STEP_ERRORS as exc:
                rows.append([c, failed_cell(exc)] + [""] * 8)
                continue
            rows.append([c, f"{m['completed']} / {m['failed']}", num(m["request_throughput"], 2),
                         num(m["output_throughput"]), stats(m["ttft_ms"]), stats(m["tpot_ms"]),
                         stats(m["itl_ms"]), stats(m["e2e_ms"]), error_counts(m),
                         num(probe.cores())])
    plot_cmd, plots = plot_step(cfg, paths, "worker")
    body = "\n\n".join([
        f"One `splitserve serve` worker ({cfg.serve_dtype}, default CPU placement: the engine "
        "pinned to every CPU but the first, the front-end on the first) on "
        f"{cfg.model or 'the bundled model'}: streaming /v1/completions, random prompts of "
        f"{n_in} tokens, {n_out} output tokens each (ignore_eos), closed loop at each "
        "concurrency. Latencies in ms as p50 / p90 / p99 (definitions at the end); "
        f"{BACKGROUND}.", table(["concurrency", "ok / failed", "req/s", "output tok/s", "TTFT",
                                 "TPOT", "ITL", "E2E", "errors", "background (cores)"], rows),
        plots, commands(cmds + plot_cmd)])
    c16 = cfg.result("worker-c16.json")
    if c16 not in paths:
        return Section(WORKER, body)
    m = load_json(c16)["metrics"]
    return Section(WORKER, body, f"one worker at concurrency 16 serves "
                   f"{num(m['request_throughput'], 2)} req/s and {num(m['output_throughput'], 0)}"
                   f" output tok/s with TTFT p50 {num(m['ttft_ms']['p50'], 0)} ms and ITL p50 "
                   f"{num(m['itl_ms']['p50'], 0)} ms")


def bench_serve_cmd(url: str, label: str, path: str, *load) -> list[str]:
    return tool("bench", "serve", "--url", url, *(str(a) for a in load), "--label", label,
                "--json", path, "--no-progress")


def worker_cmd(cfg: ReportConfig, port: int) -> list[str]:
    """One aggregated worker as a user gets it: default CPU placement (placement.py)."""
    return tool("serve", *cfg.model_args, "--dtype", cfg.serve_dtype,
                "--kv-cache-gib", "2", "--port", str(port))


def error_counts(m: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in m["errors"].items()) or "none"
