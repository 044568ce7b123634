"""A section of `splitserve bench report`: splitserve against CPU vLLM on this machine, each
server alone, in float32 and in bfloat16.

An idle CPU vLLM engine keeps a core busy, so two servers up at once on a small machine slow
whichever is being measured. Here only one server is up at a time: for each dtype and round,
vLLM is started, measured on every run of RUNS and stopped (its processes gone and the
machine given SETTLE_S to go quiet), then splitserve likewise (`serve` for the worker and
prefill runs, then `up` for the disaggregated one); the next round runs them in the other
order (alternate.py). Every server gets the same seeded prompts (`bench serve --seed SEED`).
The page shows each server's median over the rounds, each round's own number and the ratio
of the medians (reference_page.py).

vLLM is never installed by the report: `--vllm-venv VENV` names a virtualenv that
scripts/vllm_reference.sh installs CPU vLLM into (~1 GB), and the report starts vLLM through
that script (its documented CPU settings: pinned engine threads, one core left to its API
server). Without it the section says how to run it."""

from __future__ import annotations

import asyncio
import json
import os
import time

from splitserve import placement
from splitserve.bench.report.alternate import run_rows, schedule
from splitserve.bench.report.config import ReportConfig
from splitserve.bench.report.machine import LoadProbe, machine
from splitserve.bench.report.markdown import Section, failed, failed_cell
from splitserve.bench.report.reference_page import page
from splitserve.bench.report.steps import STEP_ERRORS, Service, load_json, run_step, tool
from splitserve.bench.report.worker import bench_serve_cmd
from splitserve.bench.serve.compare import settle
from splitserve.bench.server_process import free_port

REFERENCE = "Against CPU vLLM on this machine"
VLLM_START_SECONDS = 1800.0    # installs (first run) and compiles the model (every start)
SERVERS = ("vllm", "splitserve")
ROUNDS = 2
DTYPES = ("float32", "bfloat16")
SEED = 1                       # every server, round and dtype gets the same prompts
SETTLE_S = 15.0                # before each start: the longest wait for a quiet machine

# label -> (what runs, `bench serve` load); quick runs override some of the load
RUNS = {
    "worker": ("one `splitserve serve` worker, defaults",
               {"input-len": 128, "output-len": 64, "concurrency": "1,8", "num-requests": 16,
                "warmup": 2}),
    "disagg": ("`splitserve up` (1 CTX + 1 GEN), defaults",
               {"input-len": 1900, "output-len": 64, "concurrency": 8, "num-requests": 16,
                "warmup": 2}),
    # a worker's engine gets one pinned core here, as a CTX worker's does in `up`
    "prefill": ("one `splitserve serve` worker, defaults, one long prompt at a time",
                {"input-len": 2000, "output-len": 1, "concurrency": 1, "num-requests": 6,
                 "warmup": 1}),
}
QUICK = {"worker": {"num-requests": 4, "warmup": 1},
         "disagg": {"input-len": 600, "num-requests": 8, "warmup": 1},
         "prefill": {"input-len": 600, "num-requests": 2}}


def default_dtype() -> str:
    """What "defaults" means on this machine: both servers' dtype without --dtype here."""
    return "bfloat16" if machine()["native_bf16"] else "float32"


def reference(cfg: ReportConfig) -> Section:
    if not cfg.vllm_venv:
        return Section(REFERENCE, "Not run: the page was generated without `--vllm-venv VENV`. "
                       "`splitserve bench report --vllm-venv VENV` installs CPU vLLM into the "
                       "virtualenv VENV on first use (scripts/vllm_reference.sh) and adds this "
                       "section: splitserve's worker and disaggregated cluster against vLLM "
                       "serving the same model in float32 and bfloat16, each server measured "
                       "alone, in alternating order.")
    if cfg.model:
        return Section(REFERENCE, f"Not run: vLLM serves the bundled model only here, and this "
                       f"page measures {cfg.model}.")
    t0, ports, cmds, results = time.monotonic(), _ports(), [], {}
    for dtype in DTYPES:
        records = [_alone(cfg, dtype, rnd, server, ports, cmds if rnd == 0 else None)
                   for rnd, server in schedule(SERVERS, ROUNDS)]
        with open(cfg.result(f"vs-vllm-{dtype}.json"), "w") as f:
            json.dump(records, f, indent=1)
        results[dtype] = {"records": records, "step_ms": _engine_step_ms(cfg, dtype, cmds)}
    body, summary = page(results, default_dtype(), {label: what for label, (what, _) in
                                                    RUNS.items()}, cmds, time.monotonic() - t0)
    return Section(REFERENCE, body, summary)


def _ports() -> dict[str, int]:
    # chosen once: each server starts on the same port in every round, so the cited
    # commands are the ones every round ran
    return {"vllm": free_port(), "serve": free_port(), "up": free_port(3)}   # up: P+1, P+2


def _processes(cfg: ReportConfig, dtype: str, server: str,
               ports: dict[str, int]) -> list[tuple[list[str], int, tuple[str, ...]]]:
    """A server's processes one after another: (command, port, the runs measured on it)."""
    if server == "vllm":
        # the exported float32 folder is kept beside the virtualenv, as the script's default
        folder = os.path.join(os.path.dirname(os.path.abspath(cfg.vllm_venv)), "vllm-model",
                              "SmolLM2-135M-Instruct-f32")
        return [(["bash", "scripts/vllm_reference.sh", cfg.vllm_venv, folder,
                  str(ports["vllm"]), dtype], ports["vllm"], tuple(RUNS))]
    return [(tool("serve", "--dtype", dtype, "--port", str(ports["serve"])), ports["serve"],
             ("worker", "prefill")),
            (tool("up", "--dtype", dtype, "--port", str(ports["up"])), ports["up"],
             ("disagg",))]


def _alone(cfg: ReportConfig, dtype: str, rnd: int, server: str, ports: dict[str, int],
           cmds: list | None) -> dict:
    """One server in one round, alone on the machine: a round record (alternate.py)."""
    rec = {"round": rnd, "server": server, "dtype": dtype, "runs": {}, "starts": []}
    for cmd, port, labels in _processes(cfg, dtype, server, ports):
        quiet = asyncio.run(settle(SETTLE_S))
        url, name = f"http://127.0.0.1:{port}", f"vs-vllm-{dtype}-r{rnd}-{server}-{labels[0]}"
        timeout = VLLM_START_SECONDS if server == "vllm" else cfg.start_timeout
        if cmds is not None:
            cmds.append(cmd)
        try:
            with Service(cmd, url, cfg.result(f"logs/{name}-server.log"),
                         max(cfg.start_timeout, timeout)) as svc:
                rec["starts"].append({"process": _process_name(cmd), "seconds": svc.started_s,
                                      "settle": quiet})
                for label in labels:
                    rec["runs"][label] = _measure(cfg, svc, f"vs-vllm-{dtype}-r{rnd}-{server}",
                                                  label, server, cmds)
        except STEP_ERRORS as exc:
            rec["starts"].append({"process": _process_name(cmd), "error": failed(exc),
                                  "settle": quiet})
            for label in labels:
                rec["runs"].setdefault(label, {"error": failed_cell(exc)})
    return rec


def _process_name(cmd: list[str]) -> str:
    return cmd[1] if cmd[0] == "splitserve" else "vLLM"


def _measure(cfg: ReportConfig, svc: Service, prefix: str, label: str, server: str,
             cmds: list | None) -> dict:
    """One run of RUNS against the one server up: its rows, or the error."""
    load = {**RUNS[label][1], **(QUICK[label] if cfg.quick else {})}
    path = cfg.result(f"{prefix}-{label}.json")
    bench = bench_serve_cmd(svc.url, f"vs-vllm-{label}", path, "--name", server,
                            "--workload", "random", "--seed", SEED,
                            *(a for k, v in load.items() for a in (f"--{k}", v)),
                            "--timeout", 600)
    if cmds is not None:
        cmds.append(bench)
    probe = LoadProbe(svc)
    try:
        run_step(bench, 3600, cfg.result(f"logs/{prefix}-{label}.log"))
        doc = load_json(path)
    except STEP_ERRORS as exc:
        return {"error": failed_cell(exc)}
    return {"rows": run_rows(doc, server), "workload": doc["workload"],
            "background": probe.cores()}


def _engine_step_ms(cfg: ReportConfig, dtype: str, cmds: list) -> float | str:
    """The engine's own decode step at batch 1 (`bench engine`) with the worker's default
    placement: what its served c=1 ITL is held to."""
    plan = placement.plan_worker(placement.usable_cpus())
    path = cfg.result(f"vs-vllm-engine-step-{dtype}.json")
    helper = [] if plan.helper_cpu is None else ["--helper-cpu", str(plan.helper_cpu)]
    cmds.append(tool("bench", "engine", "--dtype", dtype, "--threads",
                     str(plan.engine_threads), "--cpus", placement.format_cpus(plan.engine_cpus),
                     *helper,
                     "--prefill-len", "128", "--repeats", "1", "--decode-steps", "24",
                     "--decode-prompt-len", "128", "--batch-sizes", "1", "--json", path))
    try:
        run_step(cmds[-1], 600, cfg.result(f"logs/vs-vllm-engine-step-{dtype}.log"))
        return load_json(path)["decode_ms_step"]["1"]
    except STEP_ERRORS as exc:
        return f"The engine's own decode step ({dtype}): {failed(exc)}"
