"""Section 5 of `splitserve bench report`: requests/s through the front door with one
orchestrator process against two on the same port (`splitserve up --orchestrators N`),
the tiny random model and short requests, so the orchestrator's own work per request is a
large share of the whole."""

from __future__ import annotations

import os

from splitserve.bench.report.config import ReportConfig
from splitserve.bench.report.machine import BACKGROUND, LoadProbe
from splitserve.bench.report.markdown import Section, commands, failed_cell, num, stats, table
from splitserve.bench.report.steps import STEP_ERRORS, Service, load_json, run_step, tool
from splitserve.bench.report.worker import bench_serve_cmd, error_counts
from splitserve.bench.server_process import free_port

FLEET = "Orchestrator fleet: one vs two orchestrator processes on one port"
ORCHESTRATORS = (1, 2)


def up_cmd(port: int, orchestrators: int, workers: int) -> list[str]:
    return tool("up", "--model", "tiny-random", "--dtype", "float32", "--num-ctx", str(workers),
                "--num-gen", str(workers), "--threads", "1", "--kv-cache-gib", "0.25",
                "--orchestrators", str(orchestrators), "--port", str(port))


ORCH_CPU = ("Orchestrator CPU: user + system time of the orchestrator processes (`up` itself "
            "when it runs the one orchestrator; its `--fleet-child` processes otherwise, plus "
            "`up`, which supervises) over the load step, from /proc, warm-up included, per "
            "second of the measured window. The "
            "machine has 2 cores, which the workers, their engines, the orchestrators and the "
            "load generator share: a second orchestrator process adds capacity only where a "
            "core is left over.")


def orchestrator_cpu_s(up_pid: int) -> float:
    """CPU seconds so far of `up` and of its orchestrator children (not its workers)."""
    try:
        with open(f"/proc/{up_pid}/task/{up_pid}/children") as f:
            children = [int(p) for p in f.read().split()]
    except OSError:
        children = []
    total = 0
    for pid in [up_pid, *children]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if pid == up_pid or b"--fleet-child" in cmd:
            total += int(fields[11]) + int(fields[12])      # utime stime
    return total / os.sysconf("SC_CLK_TCK")


def fleet(cfg: ReportConfig) -> Section:
    # bounded by --duration in the full run (n is out of reach), by n in the quick one
    c, n, duration, workers = (16, 200, 10, 1) if cfg.quick else (64, 100000, 30, 2)
    n_in, n_out = 16, 4
    rows, cmds, rates = [], [], {}
    for k in ORCHESTRATORS:
        port = free_port(1 + 3 * workers)       # up: its workers, then the CTX KV ports
        url, label = f"http://127.0.0.1:{port}", f"fleet-o{k}"
        path = cfg.result(f"{label}.json")
        cmds += [up_cmd(port, k, workers), bench_serve_cmd(
            url, label, path, "--workload", "random", "--input-len", n_in, "--output-len",
            n_out, "--concurrency", c, "--num-requests", n, "--duration", duration,
            "--warmup", 8, "--timeout", 120)]
        try:
            with Service(cmds[-2], url, cfg.result(f"logs/{label}-server.log"),
                         cfg.start_timeout) as svc:
                probe, cpu0 = LoadProbe(svc), orchestrator_cpu_s(svc.proc.pid)
                run_step(cmds[-1], duration + 300, cfg.result(f"logs/{label}.log"))
                cpu = orchestrator_cpu_s(svc.proc.pid) - cpu0
                background = probe.cores()
            m = load_json(path)["metrics"]
            busy = cpu / m["duration_s"]      # the orchestrators idle outside the window
        except STEP_ERRORS as exc:
            rows.append([k, failed_cell(exc)] + [""] * 7)
            continue
        rates[k] = m["request_throughput"]
        rows.append([k, f"{m['completed']} / {m['failed']}", num(m["request_throughput"], 1),
                     stats(m["ttft_ms"]), stats(m["e2e_ms"]), num(busy, 2),
                     num(1000 * cpu / max(m["completed"], 1), 2), error_counts(m),
                     num(background)])
    body = "\n\n".join([
        f"`splitserve up` with {workers} CTX and {workers} GEN workers (tiny-random, one "
        "torch thread each, workers registering with the orchestrator) and 1 or 2 "
        "orchestrator processes sharing the port (SO_REUSEPORT; the GEN router least_loaded "
        f"by the workers' reported load). `bench serve`: closed loop at concurrency {c}, "
        f"random prompts of {n_in} tokens, {n_out} output tokens, streamed, new connections "
        "spread by the kernel across the orchestrator processes. Latencies in ms as p50 / p90 "
        f"/ p99; {BACKGROUND}. For scale, the seed project's fleet measured 59, 90 and 98 "
        "req/s with 1, 4 and 8 workers.",
        table(["orchestrators", "ok / failed", "req/s", "TTFT", "E2E", "orchestrator CPU "
               "(cores)", "orchestrator CPU ms / request", "errors", "background (cores)"],
              rows), ORCH_CPU, commands(cmds)])
    summary = ""
    if len(rates) == 2 and rates[1]:
        summary = (f"two orchestrator processes serve {num(rates[2], 0)} req/s through one "
                   f"port against one's {num(rates[1], 0)} ({rates[2] / rates[1]:.2f}x)")
    return Section(FLEET, body, summary)
