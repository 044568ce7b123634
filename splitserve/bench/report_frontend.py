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
