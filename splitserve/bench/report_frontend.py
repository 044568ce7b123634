"""Section 4 of `splitserve bench report`: the GEN front-end's cost per token relay mode
(`bench frontend`) against the issue's targets."""

from __future__ import annotations

import os

from splitserve.bench.report_config import ReportConfig
from splitserve.bench.report_markdown import Section, commands, num, table
from splitserve.bench.report_steps import StepFailed, load_json, run_inprocess, run_step, tool

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
    result = load_json(path)
    targets = result.get("targets", [])
    rows = [[t["name"], num(t.get("value"), 3), f"≤ {t['bound']:.3g}",
             {True: "**PASS**", False: "FAIL"}.get(t.get("pass"), "n/a")] for t in targets]
    printed = "\n".join(ln for ln in out.splitlines() if not ln.startswith(("results:", "plot:")))
    held, held_cmd = ("", None) if cfg.quick else _held(cfg)
    body = "\n\n".join([
        "`splitserve bench frontend` sends generation_only requests straight to one GEN "
        "worker (tiny-random, with its KV pull skipped on purpose) with the prompt relayed as "
        "a JSON list, as base64 int32, or as metadata only (its length), and reads the "
        "worker's own CPU time and `gen_preprocessing` histogram (X-Sent-At → engine "
        "admission).", table(["target", "measured", "bound", "result"], rows),
        f"The tool's own table:\n\n```\n{printed.strip()}\n```",
        f"![frontend.png]({cfg.link(png)})" if os.path.exists(png) else "", held,
        commands([cmd] + ([held_cmd] if held_cmd else []))])
    passed = sum(t.get("pass") is True for t in targets)
    return Section(FRONTEND, body, f"the token relay meets {passed} of {len(targets)} "
                   "GEN front-end targets")


HELD = ("The grid above is a closed loop of one-token requests: each answer is followed at "
        "once by the next request, so the worker is always saturated and, by Little's law, "
        "latency is concurrency / throughput wherever the slowest stage is. A GEN worker in "
        "production holds its requests while they decode. The run below does that: 1024 "
        "requests in flight, each generating 8-24 tokens (ISL 1k, the longest prompts the "
        "tiny model can keep 1024 of decoding at a useful pace on 2 cores), started over a "
        "ramp so that they do not all arrive in one burst. New requests arrive as others "
        "finish, in bursts of about one engine step's finished requests; gen_preprocessing "
        "then shows how long such a burst waits in front of the event loop in each mode.")


def _held(cfg: ReportConfig) -> tuple[str, list[str]]:
    """The held-load run: (its markdown, its command)."""
    path = cfg.result("frontend-held.json")
    cmd = tool("bench", "frontend", "--isl", "1k", "--concurrency", "1024", "--max-tokens", "16",
               "--ramp-up", "8", "--duration", "30", "--requests", "100000", "--json", path,
               "--plot", cfg.result("frontend-held.png"), "--no-progress", *cfg.frontend_args)
    try:
        out = run_step(cmd, 900, cfg.result("logs/frontend-held.log"))
    except StepFailed as exc:
        return f"{HELD}\n\n**FAILED**:\n\n```\n{exc}\n```", cmd
    rows = [ln for ln in out.splitlines() if not ln.startswith(
        ("results:", "plot:", "PASS", "FAIL", "n/a"))]   # the targets belong to the grid
    return f"{HELD}\n\n```\n{chr(10).join(rows).strip()}\n```", cmd
