"""A section of `splitserve bench report`: one GEN worker with 1, 2 and 4 front-end
processes (`serve --api-server-count N`) over its one engine, measured by `bench frontend`
at the issue's point (c=1024, ISL 32k, metadata relay) and under the held load of the
front-end section (gen_preprocessing p99)."""

from __future__ import annotations

from splitserve.bench.report.config import ReportConfig
from splitserve.bench.report.markdown import Section, commands, num, table
from splitserve.bench.report.steps import load_json, run_step, tool

FRONTENDS = "Front-end processes per GEN worker"
COUNTS, QUICK_COUNTS = "1,2,4", "1,2"


def frontends(cfg: ReportConfig) -> Section:
    path, held_path = cfg.result("frontends.json"), cfg.result("frontends-held.json")
    duration, counts = ("3", QUICK_COUNTS) if cfg.quick else ("10", COUNTS)
    grid = tool("bench", "frontend", "--api-server-counts", counts, "--modes", "metadata",
                "--isl", "32k", "--concurrency", "1024", "--duration", duration,
                "--json", path, "--plot", cfg.result("frontends.png"), "--no-progress",
                *cfg.frontend_args)
    held = tool("bench", "frontend", "--api-server-counts", counts, "--modes", "metadata",
                "--isl", "1k", "--concurrency", "1024", "--max-tokens", "16",
                "--think-time", "1", "--ramp-up", "4", "--duration", "8" if cfg.quick else "20",
                "--requests", "100000", "--json", held_path,
                "--plot", cfg.result("frontends-held.png"), "--no-progress", *cfg.frontend_args)
    run_step(grid, 900, cfg.result("logs/frontends.log"))
    run_step(held, 900, cfg.result("logs/frontends-held.log"))
    rows, summary = frontend_rows(load_json(path)["runs"], load_json(held_path)["runs"])
    body = "\n\n".join([
        "One tiny-random GEN worker (its KV pull skipped, as in section 4) started with 1, 2 "
        "and 4 front-end processes on one port (SO_REUSEPORT) over its one engine process. "
        "req/s: one-token generation_only requests, prompt relayed as metadata, ISL 32k, "
        "1024 connections in a closed loop; fe CPU: the front-ends' CPU per request (all of "
        "them); held p99: gen_preprocessing under the held load of section 4 (1024 users, "
        "think time 1 s, 8-24 tokens each). The front-ends share the CPUs the engine does "
        "not get: on a 2-core machine that is one core, so more processes add no CPU there; "
        "they pay off where the front-end has cores to spread over.",
        table(["front-ends", "req/s", "vs 1", "fe CPU us/req", "pre p99 ms (c=1024)",
               "held pre p99 ms", "held req/s"], rows),
        commands([grid, held])])
    return Section(FRONTENDS, body, summary)


def frontend_rows(runs: list[dict], held_runs: list[dict]) -> tuple[list[list], str]:
    """The table's rows (one per front-end count) and the page summary's clause."""
    held = {r["frontends"]: r for r in held_runs}
    base = next((r["request_throughput"] for r in runs if r["frontends"] == 1), None)
    rows, ratios = [], []
    for r in sorted(runs, key=lambda r: r["frontends"]):
        ratio = r["request_throughput"] / base if base else None
        ratios.append(f"{r['frontends']}: {num(ratio, 2)}x")
        h = held.get(r["frontends"], {})
        rows.append([r["frontends"], num(r["request_throughput"], 0), num(ratio, 2),
                     num(r["server_cpu_per_request_us"], 0),
                     num(r["gen_preprocessing_ms"]["p99_ms"], 2),
                     num(h.get("gen_preprocessing_ms", {}).get("p99_ms"), 2),
                     num(h.get("request_throughput"), 0)])
    return rows, "front-end processes per worker, req/s vs one: " + ", ".join(ratios)
