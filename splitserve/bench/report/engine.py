"""A section of `splitserve bench report`: the engine alone (`bench engine`), prefill and
decode throughput per dtype against the issue's targets."""

from __future__ import annotations

from splitserve import placement
from splitserve.bench.report.config import ReportConfig
from splitserve.bench.report.machine import BACKGROUND, LoadProbe, machine_line, torch_isa
from splitserve.bench.report.markdown import Section, commands, failed_cell, num, table
from splitserve.bench.report.steps import STEP_ERRORS, load_json, run_inprocess, run_step, tool

TARGET_PREFILL, TARGET_DECODE8 = 1500.0, 260.0
ENGINE = "Engine: prefill and decode throughput"


def engine(cfg: ReportConfig) -> Section:
    configs = [("float32", ["--dtype", "float32"]), ("bfloat16", ["--dtype", "bfloat16"])]
    options = run_inprocess(tool("bench", "engine", "--help"))
    if "--no-pack-weights" in options:   # the same dtype with row-major weights: what packing buys
        configs.append(("bfloat16-plain", ["--dtype", "bfloat16", "--no-pack-weights"]))
    if "int8" in options.partition("--quantization")[2]:
        configs.append(("int8", ["--quantization", "int8"]))
    if "--plain-reference" in options:   # what plain PyTorch prefills on this machine today
        configs[1] = ("bfloat16", ["--dtype", "bfloat16", "--plain-reference"])
    rows, cmds, results = [], [], {}
    for name, args in configs + _kernel_configs():
        env, args = [a for a in args if "=" in a], [a for a in args if "=" not in a]
        path = cfg.result(f"engine-{name}.json")
        cmds.append([*(["env", *env] if env else []),
                     *tool("bench", "engine", *cfg.model_args, *args, *_engine_load(cfg, name),
                           "--json", path)])
        try:
            probe = LoadProbe()
            run_step(cmds[-1], 240 if cfg.quick else 600, cfg.result(f"logs/engine-{name}.log"))
            results[name] = r = {**load_json(path), "background": probe.cores()}
        except STEP_ERRORS as exc:
            rows.append([name, failed_cell(exc)] + [""] * 8)
            continue
        d, ms = r["decode_tok_s"], r["decode_ms_step"]
        layout = ", packed weights" if r.get("packed_weights") else ""
        native = r.get("kernels", "").startswith("C") and r["dtype"] == "float32"
        kernels = "C kernels" if native else "PyTorch kernels"      # they are float32 only
        if native and "borrowing" in r.get("kernels", ""):
            kernels += " + helper"
        rows.append([f"{name} ({r['dtype']} compute{layout}, {r.get('cpu_capability', '?')}, "
                     f"{kernels})",
                     f"{num(r['prefill_tok_s'])} ({r['prefill_len']} tokens)",
                     *(num(d.get(b)) for b in ("1", "8", "32")),
                     " / ".join(num(ms.get(b), 0) for b in ("1", "8", "32")),
                     _over_floor(r),
                     _verdict(r["prefill_tok_s"], TARGET_PREFILL),
                     _verdict(d.get("8"), TARGET_DECODE8), num(r["background"])])
    scope = "" if cfg.model is None else " (they are for the bundled model, not this one)"
    body = "\n\n".join([
        f"Machine: {machine_line()}; PyTorch's CPU kernels run {torch_isa()} (each "
        "configuration names its ISA; ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA lower it, and "
        "SPLITSERVE_KERNEL_MARCH the C kernels' target). In float32, attention, RoPE, SiLU-mul "
        "and the residual norms, and on one thread the linears too, run as C kernels built "
        "for this CPU (splitserve/kernels/); the -pytorch rows run them in PyTorch instead. "
        "`splitserve bench engine` times the engine alone, in "
        "one process with torch's default threads (all cores), no HTTP: prefill is one prompt "
        f"at a time; decode tok/s is the batch size over the median step time; the memory "
        "floor is the bytes a step must read (each linear's weights once, the KV so far) over "
        "the read bandwidth measured in the same run (splitserve/bench/engine/floor.py); "
        f"{BACKGROUND}.",
        table(["configuration", "prefill tok/s", "decode tok/s b=1", "b=8", "b=32",
               "ms/step b=1 / 8 / 32", "b=1 step / memory floor", "prefill ≥ 1,500",
               "decode b=8 ≥ 260",
               "background (cores)"], rows),
        "Targets from the issue, which is what a widely used engine reaches with the same "
        "model on the machine they were set on (AVX512-BF16; the reference below says how "
        f"this one compares): decode at batch 8 ≥ 260 tok/s, prefill ≥ 1,500 tok/s{scope}.",
        _kernel_note(results), _bf16_note(results), _reference_note(results), commands(cmds)])
    return Section(ENGINE, body, _engine_summary(results))


def _over_floor(r: dict) -> str:
    """'3.1× (11 ms at 24 GB/s)': batch 1's step over its memory floor."""
    f = r.get("memory_floor")
    if not f or "1" not in f.get("over_floor", {}):
        return ""
    return (f"{f['over_floor']['1']:.1f}× ({num(f['floor_ms']['1'], 1)} ms at "
            f"{f['read_gb_s']:.0f} GB/s)")


def _kernel_configs() -> list[tuple[str, list[str]]]:
    """float32 with the worker's default placement (its engine's CPUs and threads: where
    the C kernels run), with and without them, and on an AVX-512 machine the same two with
    PyTorch, oneDNN and the kernels all held to AVX2 (what an AVX2 machine gets)."""
    plan = placement.plan_worker(placement.usable_cpus())
    alone = ["--dtype", "float32", "--threads", str(plan.engine_threads), "--cpus",
             placement.format_cpus(plan.engine_cpus)]
    helper = [] if plan.helper_cpu is None else ["--helper-cpu", str(plan.helper_cpu)]
    worker = [*alone, *helper]
    out = [("float32-worker", worker),
           ("float32-worker-pytorch", ["SPLITSERVE_NATIVE_KERNELS=0", *worker])]
    if helper:   # the kernels without the front-end CPU's idle time
        out.append(("float32-worker-no-helper", alone))
    if torch_isa().startswith("AVX512"):
        avx2 = ["ATEN_CPU_CAPABILITY=avx2", "ONEDNN_MAX_CPU_ISA=AVX2"]
        out += [("float32-worker-avx2", [*avx2, "SPLITSERVE_KERNEL_MARCH=haswell", *worker]),
                ("float32-worker-avx2-pytorch", [*avx2, "SPLITSERVE_NATIVE_KERNELS=0", *worker])]
    return out


def _native_bf16() -> bool:
    """What PyTorch computes bfloat16 with here, not only what the CPU flags say: an AVX512-BF16
    CPU held to AVX2 (ATEN_CPU_CAPABILITY=avx2) converts in software like an AVX2 one."""
    import torch
    from splitserve.platforms.cpu import auto_dtype
    return auto_dtype() == torch.bfloat16


def _verdict(value, target: float) -> str:
    return "–" if value is None else ("**PASS**" if value >= target else "FAIL")


def _engine_load(cfg: ReportConfig, name: str) -> list[str]:
    """Bounded settings: bfloat16 without native support is ~10x slower, so fewer steps."""
    slow = name.startswith("bfloat16") and not _native_bf16()
    if slow and cfg.quick:
        return ["--prefill-len", "64", "--repeats", "1", "--decode-steps", "2",
                "--decode-prompt-len", "8", "--batch-sizes", "1,8"]
    if slow or cfg.quick:
        return ["--prefill-len", "128", "--repeats", "1", "--decode-steps", "4",
                "--decode-prompt-len", "16", "--batch-sizes", "1,8,32"]
    # Medians of 5 prefills and 24 decode steps: this VM's speed drifts within a run.
    return ["--prefill-len", "512", "--repeats", "5", "--decode-steps", "24",
            "--decode-prompt-len", "32", "--batch-sizes", "1,8,32"]


def _kernel_note(results: dict) -> str:
    """What the C kernels buy in float32 with the worker's placement, at this CPU's ISA and
    held to AVX2."""
    clauses = [_ratios(results, ours, theirs, "at {isa},")
               for ours, theirs in (("float32-worker", "float32-worker-pytorch"),
                                    ("float32-worker-avx2", "float32-worker-avx2-pytorch"))]
    clauses = [c for c in clauses if c]
    if not clauses:
        return ""
    note = ("The float32-worker rows run as a `serve` worker's engine does by default (its "
            "CPUs and threads, and on a small machine its kernels' helper thread on the "
            "front-end's CPU); there the C kernels against the same engine in PyTorch "
            "(oneDNN's packed linears, SDPA, separate elementwise kernels), as throughput "
            "ratios: " + "; ".join(clauses) + ".")
    helper = _ratios(results, "float32-worker", "float32-worker-no-helper", "")
    if helper:
        note += (" The helper thread (splitserve/model/native_pool.py: the C kernels "
                 "borrow the front-end CPU's idle time, at SCHED_IDLE) against the "
                 f"kernels on the engine's CPU alone:{helper}.")
    return note


def _ratios(results: dict, ours: str, theirs: str, lead: str) -> str:
    """'<lead> prefill 1.35×, decode b=1 1.31×, ...': ours' throughput over theirs'."""
    a, b = results.get(ours), results.get(theirs)
    if not a or not b or not a["decode_tok_s"].get("1") or not b["decode_tok_s"].get("1"):
        return ""
    speedups = [f"prefill {a['prefill_tok_s'] / b['prefill_tok_s']:.2f}×"] + [
        f"decode b={n} {a['decode_tok_s'][n] / b['decode_tok_s'][n]:.2f}×"
        for n in ("1", "8", "32") if a["decode_tok_s"].get(n) and b["decode_tok_s"].get(n)]
    return f"{lead.format(isa=a.get('cpu_capability', '?'))} {', '.join(speedups)}"


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
               "not pay (`--dtype auto` picks float32 here)" if not _native_bf16()
               else "unexpected, as this CPU computes bfloat16 natively")
        text = (f"**bfloat16 is slower than float32 on this CPU** at {' and '.join(slower)} "
                f"(bfloat16 vs float32: {compare}); {why}. bfloat16 runs fewer, shorter steps "
                "to fit the time budget (see its command).")
    noisy = max(fp32["background"], bf16["background"])
    return text + (f" Other processes kept up to {noisy:.1f} cores busy during these runs, "
                   "which distorts the comparison." if noisy > 0.3 else "")


def _reference_note(results: dict) -> str:
    r = results.get("bfloat16") or {}
    ref = r.get("plain_reference_prefill_tok_s")
    if not ref:
        return ""
    return (f"A plain PyTorch forward of the same shapes in bfloat16 (one nn.Linear per "
            f"projection, SDPA, random weights: `--plain-reference`, "
            f"splitserve/bench/engine/plain_reference.py) prefilled {num(ref)} tok/s over "
            f"{r['prefill_len']} tokens in the same run; the engine's bfloat16 prefill is "
            f"{r['prefill_tok_s'] / ref:.2f}× that. Where the targets were measured, plain "
            "PyTorch 2.13 prefilled 512 bfloat16 tokens at about 1,800 tok/s; compare the "
            "reference here with that before comparing the engine with 1,500.")


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
