"""The markdown of the section against CPU vLLM (reference.py): per dtype, one table of both
servers' medians over the rounds with every round's number beside them, the ratio of the
medians, the order the servers ran in, and the targets' verdicts."""

from __future__ import annotations

import statistics

from splitserve.bench.report.alternate import combine
from splitserve.bench.report.machine import machine, torch_isa
from splitserve.bench.report.markdown import commands, num, table

OURS, THEIRS = "splitserve", "vllm"
NAMES = {OURS: "splitserve", THEIRS: "vLLM"}
# (row key, header, digits)
SHOWN = (("output_throughput", "out tok/s", 1), ("ttft_p50_ms", "TTFT p50", 0),
         ("ttft_p99_ms", "TTFT p99", 0), ("itl_mean_ms", "ITL avg", 1),
         ("itl_p99_ms", "ITL p99", 1))

# (run, concurrency, ratio key, bound, what the issue asks): a ratio of splitserve to vLLM
TARGETS = (("worker", 8, "output_throughput", 1.3, "c=8 output tok/s >= 1.3x vLLM's"),
           ("worker", 1, "itl_mean_ms", 1.0, "c=1 ITL avg <= vLLM's"),
           ("worker", 1, "ttft_p50_ms", 1.0, "c=1 TTFT p50 <= vLLM's"),
           ("worker", 8, "ttft_p50_ms", 1.0, "c=8 TTFT p50 <= vLLM's"),
           ("disagg", 8, "itl_p99_ms", 0.2, "ITL p99 <= 1/5 of vLLM's"),
           ("disagg", 8, "output_throughput", 1.0, "output tok/s >= 1.0x vLLM's"),
           ("prefill", 1, "ttft_p50_ms", 1.0, "a 2,000-token prompt's TTFT p50 <= vLLM's"))


def page(results: dict, default: str, whats: dict[str, str], cmds: list,
         elapsed_s: float) -> tuple[str, str]:
    """(the section's body, its summary clause) from {dtype: {"records", "step_ms"}}."""
    parts, summary = [intro(default, len(next(iter(results.values()))["records"]) // 2)], ""
    for dtype, got in results.items():
        points = combine(got["records"], OURS, THEIRS)
        mark = " (this machine's default)" if dtype == default else ""
        parts += [f"### {dtype}{mark}", results_table(points, got["records"]),
                  order(got["records"]), step_note(dtype, got["step_ms"]),
                  "Targets (ratios of the medians)" + (", with defaults:" if mark else ":"),
                  targets(points, got["step_ms"])]
        if dtype == default:
            summary = summary_clause(points, dtype, whats, workloads(got["records"]))
    records = [r for got in results.values() for r in got["records"]]
    parts += [runs_note(workloads(records), whats),
              commands(cmds) + "\n\n" + timing(records, elapsed_s)]
    return "\n\n".join(parts), summary


def intro(default: str, rounds: int) -> str:
    m = machine()
    return (f"The machine: {m['nproc']} cores, {m['cpu_model']}, ISA flags "
            f"{', '.join(m['isa']) or 'no AVX2/AVX512'} (PyTorch's kernels run at "
            f"{torch_isa()}; native bfloat16: {'yes' if m['native_bf16'] else 'no'}), so "
            f"splitserve's default dtype here is **{default}**: that is what \"defaults\" "
            "means in the targets. Each server runs alone: for each dtype and each of "
            f"{rounds} rounds, one server is started, measured on every run below and stopped "
            "(its processes gone, then up to 15 s for the machine to go quiet), then the other;"
            " odd rounds start with vLLM, even ones with splitserve, so neither always runs "
            "first on a machine whose speed drifts. Both get the same seeded prompts "
            "(streaming /v1/completions, ignore_eos, closed loop) and the same `--dtype`; vLLM "
            "runs as scripts/vllm_reference.sh starts it. A cell is the median over the rounds "
            "with each round's own number after it, in round order; ratios are of the medians,"
            " splitserve / vLLM: above 1 is faster for tok/s, below 1 is faster for latencies."
            " splitserve's servers run with their defaults but for `--dtype`. Background: "
            "cores kept busy during the run by processes other than the server measured and "
            "the load generator (other jobs on this shared VM).")


def _rounds_cell(values: list, digits: int) -> str:
    known = [v for v in values if v is not None]
    mid = statistics.median(known) if known else None
    return f"{num(mid, digits)} ({' / '.join(num(v, digits) for v in values)})"


def results_table(points: dict, records: list[dict]) -> str:
    background = _backgrounds(records)
    rows = []
    for (label, c), point in sorted(points.items(), key=lambda p: (p[0][0] != "worker", p[0])):
        for name in (THEIRS, OURS):
            got = point["servers"].get(name)
            if got is None:
                continue
            rounds = got["rounds"]
            rows.append([label, f"c={c}", NAMES[name], f"{got['completed']} / {got['failed']}",
                         *(_rounds_cell([r and r[k] for r in rounds], d) for k, _, d in SHOWN),
                         _rounds_cell(background.get((label, name), []), 1)])
        rows.append([label, f"c={c}", "**ratio**", "",
                     *(num(point["ratio"][k], 2) for k, _, _ in SHOWN), ""])
    errors = [f"round {r['round'] + 1}, {NAMES[r['server']]}, {label}: {run['error']}"
              for r in records for label, run in r["runs"].items() if "error" in run]
    return (table(["run", "load", "server", "ok / failed", *(h for _, h, _ in SHOWN),
                   "background (cores)"], rows)
            + ("\n\nFailed: " + "; ".join(errors) if errors else ""))


def _backgrounds(records: list[dict]) -> dict:
    out: dict = {}
    for rec in sorted(records, key=lambda r: r["round"]):
        for label, run in rec["runs"].items():
            out.setdefault((label, rec["server"]), []).append(run.get("background"))
    return out


def order(records: list[dict]) -> str:
    """The servers in the order they ran, each start's time and how busy the machine was."""
    rounds: dict = {}
    for rec in records:
        starts = ", ".join(f"`{s['process']}` " + (f"started in {s['seconds']:.0f} s"
                                                     if "seconds" in s else "did not start")
                           for s in rec["starts"])
        busy = [s["settle"]["busy_cores"] for s in rec["starts"]
                if s["settle"]["busy_cores"] is not None]
        quiet = f"; {max(busy):.1f} cores busy before it" if busy else ""
        rounds.setdefault(rec["round"], []).append(f"{NAMES[rec['server']]} ({starts}{quiet})")
    return "Order: " + "; ".join(f"round {i + 1}: " + ", then ".join(s)
                                 for i, s in sorted(rounds.items())) + "."


def step_note(dtype: str, step_ms: float | str) -> str:
    if isinstance(step_ms, str):
        return step_ms
    return (f"The engine alone (`bench engine`, {dtype}, the worker's default placement and "
            f"kernels' helper, 128 tokens of context) decodes at batch 1 in {num(step_ms)} ms a "
            f"step.")


def targets(points: dict, step_ms: float | str | None = None) -> str:
    """The issue's targets against the ratios of the medians: PASS / FAIL per row."""
    rows = []
    for run, c, key, bound, what in TARGETS:
        value = (points.get((run, c)) or {}).get("ratio", {}).get(key)
        ok = value is not None and (value >= bound if key == "output_throughput"
                                    else value <= bound)
        rows.append([run, what, num(value, 2), "**PASS**" if ok else "FAIL"])
    ours = ((points.get(("worker", 1)) or {}).get("servers") or {}).get(OURS)
    itl = ours["median"]["itl_mean_ms"] if ours else None
    if isinstance(step_ms, float) and itl:
        rows.append(["worker", "c=1 ITL avg <= 1.25x the engine's own decode step",
                     num(itl / step_ms, 2), "**PASS**" if itl <= 1.25 * step_ms else "FAIL"])
    return table(["run", "target", "measured ratio", "verdict"], rows)


def summary_clause(points: dict, dtype: str, whats: dict[str, str], loads: dict) -> str:
    clauses = []
    for (label, c), point in sorted(points.items(), key=lambda p: (list(whats).index(p[0][0]),
                                                                   p[0][1])):
        ratio = point["ratio"]
        if label == "prefill" and ratio["ttft_p50_ms"] is not None:
            clauses.append(f"a {loads[label]['input_len']:,}-token prompt takes "
                           f"{num(ratio['ttft_p50_ms'], 2)}x vLLM's TTFT p50")
        elif c == 8 and ratio["output_throughput"] is not None:
            clauses.append(f"{whats[label].split(',')[0]} at c=8 gives "
                           f"{num(ratio['output_throughput'], 2)}x vLLM's output tok/s at "
                           f"{num(ratio['itl_p99_ms'], 2)}x its ITL p99")
    return (f"against CPU vLLM, each server alone ({dtype}, medians of alternating rounds): "
            + "; ".join(clauses)) if clauses else ""


def workloads(records: list[dict]) -> dict[str, dict]:
    """Each run's workload (the same for every round and server: one seed)."""
    seen: dict = {}
    for rec in records:
        for label, run in rec["runs"].items():
            if "workload" in run:
                seen.setdefault(label, run["workload"])
    return seen


def runs_note(loads: dict[str, dict], whats: dict[str, str]) -> str:
    return "The runs (vLLM serves each of them as its one server): " + "; ".join(
        f"**{label}**: {what}"
        + (f", prompts of {loads[label]['input_len']:,} tokens, {loads[label]['output_len']} "
           f"output tokens, seed {loads[label]['seed']}" if label in loads else "")
        for label, what in whats.items()) + "."


def timing(records: list[dict], elapsed_s: float) -> str:
    """The section's wall time and what vLLM's starts cost (the first compiles)."""
    vllm = [s["seconds"] for r in records if r["server"] == THEIRS for s in r["starts"] if "seconds" in s]
    starts = (f"; vLLM's {len(vllm)} starts took {', '.join(f'{s:.0f}' for s in vllm)} s "
              "(each compiles the model: scripts/vllm_reference.sh says why)"
              if vllm else "")
    return (f"Each round runs the commands above again (round 1 of each dtype is cited). The "
            f"section took {elapsed_s / 60:.1f} min{starts}.")
