"""A section of `splitserve bench report`: what structured output costs. The sampler's mask
per step (`bench engine --sampler --grammar`), and one worker serving the same chats with
and without a JSON schema, alternating runs (`bench serve --response-format`)."""

from __future__ import annotations

import statistics

from splitserve.bench.report.config import ReportConfig
from splitserve.bench.report.machine import BACKGROUND
from splitserve.bench.report.markdown import Section, commands, failed_cell, num, table
from splitserve.bench.report.steps import STEP_ERRORS, Service, load_json, run_step, tool
from splitserve.bench.report.worker import bench_serve_cmd, worker_cmd
from splitserve.bench.server_process import free_port

STRUCTURED = "Structured output: the mask's cost, and JSON-schema requests against plain ones"
FORMATS = ("text", "json_schema")
TARGET = 0.85        # JSON-schema output tok/s at c=8 at least this share of plain requests'


def structured(cfg: ReportConfig) -> Section:
    cmds, mask_rows = [], []
    path = cfg.result("engine-sampler-grammar.json")
    cmds.append(tool("bench", "engine", "--model", "tiny-random", "--dtype", "float32",
                     "--threads", "1", "--sampler", "--grammar", "--batch-sizes", "1,32",
                     "--json", path))
    try:
        run_step(cmds[-1], 600, cfg.result("logs/engine-sampler-grammar.log"))
        ms = load_json(path)["sampler_ms"]
        for kind in ("greedy", "json_schema"):
            if kind in ms:
                mask_rows.append([kind, *(num(ms[kind].get(b), 3) for b in ("1", "32"))])
    except STEP_ERRORS as exc:
        mask_rows.append(["sampler", failed_cell(exc), ""])
    runs, rows, ratio = _serve_runs(cfg, cmds), [], None
    for fmt in FORMATS:
        tps = [r["output_throughput"] for r in runs[fmt]]
        itl = [r["itl_ms"]["p50"] for r in runs[fmt] if r["itl_ms"]["p50"] is not None]
        rows.append([fmt, ", ".join(num(t) for t in tps) or "failed",
                     num(statistics.median(tps)) if tps else "–",
                     num(statistics.median(itl)) if itl else "–"])
    if runs["text"] and runs["json_schema"]:
        ratio = (statistics.median(r["output_throughput"] for r in runs["json_schema"])
                 / statistics.median(r["output_throughput"] for r in runs["text"]))
    verdict = "" if ratio is None else (
        f"JSON-schema requests ran at {ratio:.2f}× the output tok/s of the same requests without "
        f"one ({'PASS' if ratio >= TARGET else 'FAIL'}: the bar is {TARGET:.2f}×). Their answers "
        "end when the object closes, so they may generate fewer tokens than max_tokens.")
    body = "\n\n".join([
        "The token mask (llguidance, applied in the engine's sampler), per sampler call in ms, "
        "the tiny model's vocabulary on one thread, median of the benchmark's passes: greedy "
        "rows, and greedy rows under a JSON schema (each at a different point of its answer):",
        table(["rows", "batch 1 (ms)", "batch 32 (ms)"], mask_rows),
        f"One `splitserve serve` worker ({cfg.serve_dtype}) on {cfg.model or 'the bundled model'}"
        ": chat, random prompts of 128 words, max_tokens 64, concurrency 8, the runs "
        "alternating between plain requests and requests under a JSON schema of one free "
        f"string (`--response-format json_schema`); {BACKGROUND}.",
        table(["response_format", "output tok/s, each run", "median", "ITL p50 (median, ms)"],
              rows), verdict, commands(cmds)])
    summary = None if ratio is None else (f"JSON-schema requests keep {ratio:.2f}× the output "
                                          "tok/s of plain ones at concurrency 8")
    return Section(STRUCTURED, body, summary)


def _serve_runs(cfg: ReportConfig, cmds: list) -> dict[str, list[dict]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = worker_cmd(cfg, port)
    cmds.append(serve)
    runs: dict[str, list[dict]] = {fmt: [] for fmt in FORMATS}
    repeats = 1 if cfg.quick else 3
    with Service(serve, url, cfg.result("logs/structured-server.log"), cfg.start_timeout):
        for i in range(repeats):
            for fmt in FORMATS:
                path = cfg.result(f"structured-{fmt}-{i}.json")
                cmd = bench_serve_cmd(url, f"structured-{fmt}", path, "--endpoint", "chat",
                                      "--workload", "random", "--input-len", 128,
                                      "--output-len", 16 if cfg.quick else 64,
                                      "--concurrency", 8, "--num-requests",
                                      8 if cfg.quick else 24, "--warmup", 2,
                                      "--response-format", fmt, "--seed", i)
                if i == 0:
                    cmds.append(cmd)
                try:
                    run_step(cmd, 900, cfg.result(f"logs/structured-{fmt}-{i}.log"))
                    runs[fmt].append(load_json(path)["metrics"])
                except STEP_ERRORS:
                    continue
    return runs
