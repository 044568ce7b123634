"""A section of `splitserve bench report`: splitserve against CPU vLLM on this machine, in one
sitting, with the same workload, dtype (float32) and load generator (`bench serve --compare`).

vLLM is never installed by the report: `--vllm-venv VENV` names a virtualenv that
scripts/vllm_reference.sh installs CPU vLLM into (~1 GB), and the report starts vLLM through
that script (its documented CPU settings: pinned engine threads, one core left to its API
server) for the length of the section. Without it the section says how to run it."""

from __future__ import annotations

import os

from splitserve import placement
from splitserve.bench.report.config import ReportConfig
from splitserve.bench.report.machine import LoadProbe, torch_isa
from splitserve.bench.report.markdown import Section, commands, failed, num, table
from splitserve.bench.report.steps import STEP_ERRORS, Service, load_json, run_step, tool
from splitserve.bench.report.worker import bench_serve_cmd
from splitserve.bench.server_process import free_port

REFERENCE = "Against CPU vLLM on this machine"
VLLM_START_SECONDS = 1800.0    # installs (first run) and compiles the model with inductor

# label -> (what runs, `bench serve` load); quick runs override some of the load
RUNS = {
    "worker": ("one `splitserve serve` worker, defaults",
               {"input-len": 128, "output-len": 64, "concurrency": "1,8", "num-requests": 16,
                "warmup": 2}),
    "disagg": ("`splitserve up` (1 CTX + 1 GEN), defaults",
               {"input-len": 1900, "output-len": 64, "concurrency": 8, "num-requests": 24,
                "warmup": 2}),
    # a worker's engine gets one pinned core here, as a CTX worker's does in `up`
    "prefill": ("one `splitserve serve` worker, defaults, one long prompt at a time",
                {"input-len": 2000, "output-len": 1, "concurrency": 1, "num-requests": 6,
                 "warmup": 1}),
}
QUICK = {"worker": {"num-requests": 4, "warmup": 1},
         "disagg": {"input-len": 600, "num-requests": 8, "warmup": 1},
         "prefill": {"input-len": 600, "num-requests": 2}}


def reference(cfg: ReportConfig) -> Section:
    if not cfg.vllm_venv:
        return Section(REFERENCE, "Not run: the page was generated without `--vllm-venv VENV`. "
                       "`splitserve bench report --vllm-venv VENV` installs CPU vLLM into the "
                       "virtualenv VENV on first use (scripts/vllm_reference.sh) and adds this "
                       "section: splitserve's worker and disaggregated cluster against vLLM "
                       "serving the same model in float32, measured side by side.")
    if cfg.model:
        return Section(REFERENCE, f"Not run: vLLM serves the bundled model only here, and this "
                       f"page measures {cfg.model}.")
    port = free_port()
    vllm_url = f"http://127.0.0.1:{port}"
    # The exported float32 folder is kept beside the virtualenv, as the script's default.
    folder = os.path.join(os.path.dirname(os.path.abspath(cfg.vllm_venv)), "vllm-model",
                          "SmolLM2-135M-Instruct-f32")
    vllm = ["bash", "scripts/vllm_reference.sh", cfg.vllm_venv, folder, str(port)]
    cmds, parts = [vllm], []
    try:
        with Service(vllm, vllm_url, cfg.result("logs/vllm-server.log"),
                     max(cfg.start_timeout, VLLM_START_SECONDS)):
            parts += [_compare(cfg, label, vllm_url, cmds) for label in RUNS]
    except STEP_ERRORS as exc:
        parts.append(f"vLLM did not start: {failed(exc)}")
    step_ms = _engine_step_ms(cfg, cmds)
    docs = [d for d in parts if isinstance(d, dict)]
    body = "\n\n".join([
        f"Both servers on this machine (PyTorch kernels at {torch_isa()}), float32, the bundled "
        "model, streaming /v1/completions with ignore_eos, closed loop, the same prompts for "
        "each (`bench serve --compare`, runs interleaved level by level). vLLM runs as "
        "scripts/vllm_reference.sh starts it. Ratios are splitserve / vLLM: above 1 is faster "
        "for tok/s, below 1 is faster for latencies.",
        *(_table(d) if isinstance(d, dict) else d for d in parts), _step_note(step_ms),
        targets(docs, step_ms), commands(cmds)])
    return Section(REFERENCE, body, _summary(docs))


def _compare(cfg: ReportConfig, label: str, vllm_url: str, cmds: list) -> dict | str:
    what, load = RUNS[label]
    load = {**load, **(QUICK[label] if cfg.quick else {})}
    port = free_port(3)          # `up --port P` puts its CTX on P+1, its GEN on P+2
    url = f"http://127.0.0.1:{port}"
    server = (tool("serve", *cfg.model_args, "--dtype", "float32", "--port", str(port))
              if label != "disagg" else
              tool("up", *cfg.model_args, "--dtype", "float32", "--port", str(port)))
    path = cfg.result(f"vs-vllm-{label}.json")
    bench = bench_serve_cmd(url, f"vs-vllm-{label}", path, "--name", "splitserve",
                            "--compare", f"vllm={vllm_url}", "--workload", "random",
                            *(a for k, v in load.items() for a in (f"--{k}", v)),
                            "--timeout", 600)
    cmds += [server, bench]
    try:
        with Service(server, url, cfg.result(f"logs/vs-vllm-{label}-server.log"),
                     cfg.start_timeout) as svc:
            probe = LoadProbe(svc)
            run_step(bench, 3600, cfg.result(f"logs/vs-vllm-{label}.log"))
            doc = load_json(path)
            doc["what"], doc["background"] = what, probe.cores()
            return doc
    except STEP_ERRORS as exc:
        return f"{what}: {failed(exc)}"


def _engine_step_ms(cfg: ReportConfig, cmds: list) -> float | str:
    """The engine's own decode step at batch 1 (`bench engine`, float32) with the worker's
    default placement: what its served c=1 ITL is held to."""
    plan = placement.plan_worker(placement.usable_cpus())
    path = cfg.result("vs-vllm-engine-step.json")
    helper = [] if plan.helper_cpu is None else ["--helper-cpu", str(plan.helper_cpu)]
    cmds.append(tool("bench", "engine", "--dtype", "float32", "--threads",
                     str(plan.engine_threads), "--cpus", placement.format_cpus(plan.engine_cpus),
                     *helper,
                     "--prefill-len", "128", "--repeats", "1", "--decode-steps", "24",
                     "--decode-prompt-len", "128", "--batch-sizes", "1", "--json", path))
    try:
        run_step(cmds[-1], 600, cfg.result("logs/vs-vllm-engine-step.log"))
        return load_json(path)["decode_ms_step"]["1"]
    except STEP_ERRORS as exc:
        return f"The engine's own decode step: {failed(exc)}"


def _step_note(step_ms: float | str) -> str:
    if isinstance(step_ms, str):
        return step_ms
    return (f"The engine alone (`bench engine`, float32, the worker's default placement and "
            f"kernels' helper, 128 tokens of context) decodes at batch 1 in {num(step_ms)} ms a "
            f"step.")


def _table(doc: dict) -> str:
    wl = doc["workload"]
    rows = [[r["server"], f"c={r['concurrency']}", f"{r['completed']} / {r['failed']}",
             num(r["output_throughput"]), num(r["ttft_p50_ms"], 0), num(r["ttft_p99_ms"], 0),
             num(r["itl_mean_ms"]), num(r["itl_p99_ms"]),
             _ratio(r, "output_throughput"), _ratio(r, "ttft_p50_ms"),
             _ratio(r, "itl_mean_ms"), _ratio(r, "itl_p99_ms")] for r in _vs_first(doc["rows"])]
    return (f"**{doc['what']}** vs vLLM: prompts of {wl['input_len']} tokens, {wl['output_len']} "
            f"output tokens; processes other than splitserve's kept {doc['background']:.1f} "
            "cores busy during the step, vLLM serving its own turns of the interleaved runs "
            "among them.\n\n"
            + table(["server", "load", "ok / failed", "out tok/s", "TTFT p50", "TTFT p99",
                     "ITL avg", "ITL p99", "tok/s ratio", "TTFT p50 ratio", "ITL avg ratio",
                     "ITL p99 ratio"],
                    rows))


def _vs_first(rows: list[dict]) -> list[dict]:
    """The rows with ratios of splitserve (the first server) to vLLM at the same load."""
    out = []
    for i in range(0, len(rows), 2):
        ours, theirs = rows[i], rows[i + 1]
        ratios = {k: (ours[k] / theirs[k] if ours[k] is not None and theirs[k] else None)
                  for k in ("output_throughput", "itl_mean_ms", "itl_p99_ms", "ttft_p50_ms")}
        out += [{**ours, "vs": ratios}, {**theirs, "vs": None}]
    return out


def _ratio(row: dict, key: str) -> str:
    return "" if row["vs"] is None else num(row["vs"][key], 2)


# (run, concurrency, ratio key, bound, what the issue asks): a ratio of splitserve to vLLM
TARGETS = (("worker", 8, "output_throughput", 1.3, "c=8 output tok/s >= 1.3x vLLM's"),
           ("worker", 1, "itl_mean_ms", 1.0, "c=1 ITL avg <= vLLM's"),
           ("worker", 1, "ttft_p50_ms", 1.0, "c=1 TTFT p50 <= vLLM's"),
           ("worker", 8, "ttft_p50_ms", 1.0, "c=8 TTFT p50 <= vLLM's"),
           ("disagg", 8, "itl_p99_ms", 0.2, "ITL p99 <= 1/5 of vLLM's"),
           ("disagg", 8, "output_throughput", 1.0, "output tok/s >= 1.0x vLLM's"),
           ("prefill", 1, "ttft_p50_ms", 1.0, "a 2,000-token prompt's TTFT p50 <= vLLM's"))


def targets(docs: list[dict], step_ms: float | str | None = None) -> str:
    """The issue's targets against the measured ratios: PASS / FAIL per row."""
    ratios = {(d["label"].removeprefix("vs-vllm-"), r["concurrency"]): r["vs"]
              for d in docs for r in _vs_first(d["rows"]) if r["vs"] is not None}
    rows = []
    for run, c, key, bound, what in TARGETS:
        value = (ratios.get((run, c)) or {}).get(key)
        ok = value is not None and (value >= bound if key == "output_throughput"
                                    else value <= bound)
        rows.append([run, what, num(value, 2), "**PASS**" if ok else "FAIL"])
    itl = next((r["itl_mean_ms"] for d in docs if d["label"] == "vs-vllm-worker"
                for r in d["rows"] if r["server"] == "splitserve" and r["concurrency"] == 1),
               None)
    if isinstance(step_ms, float) and itl:
        rows.append(["worker", "c=1 ITL avg <= 1.25x the engine's own decode step",
                     num(itl / step_ms, 2), "**PASS**" if itl <= 1.25 * step_ms else "FAIL"])
    return table(["run", "target", "measured ratio", "verdict"], rows)


def _summary(docs: list[dict]) -> str:
    clauses = []
    for doc in docs:
        for r in _vs_first(doc["rows"]):
            if r["vs"] is None:
                continue
            if doc["label"] == "vs-vllm-prefill":
                clauses.append(f"a {doc['workload']['input_len']:,}-token prompt takes "
                               f"{num(r['vs']['ttft_p50_ms'], 2)}x vLLM's TTFT p50")
            elif r["concurrency"] == 8:
                clauses.append(f"{doc['what'].split(',')[0]} at c=8 gives "
                               f"{num(r['vs']['output_throughput'], 2)}x vLLM's output tok/s "
                               f"at {num(r['vs']['itl_p99_ms'], 2)}x its ITL p99")
    return "; ".join(clauses)
