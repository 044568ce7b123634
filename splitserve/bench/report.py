"""`splitserve bench report`: regenerate docs/benchmarks.md from real runs, in one command.

Every number on the page comes from running the real tools as subprocesses (`bench engine`,
`serve` or `up` + `bench serve`, `bench frontend`, `bench plot`) and reading the JSON they
write under --results-dir; the page cites each exact command. Every step is bounded (request
counts, --duration, a subprocess timeout); a step that fails is written into the page as a
failure with its error, and the report goes on. Servers run in their own process group and
are stopped with SIGINT (SIGKILL of the group if they hang) in a `finally`: nothing is left
running. The sections themselves are in report_sections.py.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import resource
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from splitserve.orchestrator.up import wait_healthy
from splitserve.server.metrics import parse_prometheus

_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ReportConfig:
    quick: bool = False
    model: str | None = None            # passed to every step; None: the bundled model
    dtype: str | None = None            # of served workers; None: float32 unless bf16 is native
    out: str = "docs/benchmarks.md"
    img_dir: str = "docs/img"
    results_dir: str = "bench-results"
    frontend_args: tuple[str, ...] = ()
    start_timeout: float = 300.0        # seconds for a server to answer /health
    command: str = "splitserve bench report"

    def __post_init__(self):
        if self.dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
        if not self.start_timeout > 0:
            raise ValueError(f"--start-timeout must be positive, got {self.start_timeout}")

    @property
    def serve_dtype(self) -> str:
        return self.dtype or ("bfloat16" if machine()["native_bf16"] else "float32")

    @property
    def model_args(self) -> list[str]:
        return ["--model", self.model] if self.model else []

    def result(self, name: str) -> str:
        return os.path.join(self.results_dir, name)

    def img(self, name: str) -> str:
        return os.path.join(self.img_dir, name)

    def link(self, path: str) -> str:
        """`path` as the page links it: relative to the page's folder."""
        return os.path.relpath(path, os.path.dirname(os.path.abspath(self.out)))


@dataclass
class Section:
    title: str
    body: str
    summary: str = ""      # one clause for the page's summary paragraph


# -- markdown ---------------------------------------------------------------------------------
def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def num(value, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def stats(s: dict, keys=("p50", "p90", "p99")) -> str:
    """'p50 / p90 / p99' of a latency_stats dict in ms, whole ms from 100 up."""
    return " / ".join(num(s.get(k), 0 if (s.get(k) or 0) >= 100 else 1) for k in keys)


def commands(cmds: list[list[str]]) -> str:
    return "Commands:\n\n```bash\n" + "\n".join(shown(c) for c in cmds) + "\n```"


def failed(exc: BaseException) -> str:
    return f"**FAILED** ({type(exc).__name__}):\n\n```\n{str(exc).strip()}\n```"


# -- steps: the real tools as subprocesses ----------------------------------------------------
class StepFailed(Exception):
    pass


def tool(*args: str) -> list[str]:
    """A splitserve command line as the page cites it."""
    return ["splitserve", *args]


def shown(cmd: list[str]) -> str:
    return shlex.join(cmd)


def _argv(cmd: list[str]) -> list[str]:
    # The report's own interpreter and checkout, whatever `splitserve` is first on PATH.
    return [sys.executable, "-m", "splitserve.cli", *cmd[1:]]


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_step(cmd: list[str], timeout: float, log: str | None = None) -> str:
    """Run one tool to completion; its stdout. StepFailed (with the stderr tail) otherwise."""
    try:
        proc = subprocess.run(_argv(cmd), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:     # subprocess.run has killed and reaped it
        raise StepFailed(f"timed out after {timeout:.0f} s: {shown(cmd)}") from None
    if log:
        os.makedirs(os.path.dirname(log), exist_ok=True)
        with open(log, "w") as f:
            f.write(f"$ {shown(cmd)}\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    if proc.returncode != 0:
        raise StepFailed(f"exit code {proc.returncode}: {shown(cmd)}\n{_tail(proc.stderr)}")
    return proc.stdout


def run_inprocess(cmd: list[str]) -> str:
    """A quick tool (--help, --explain, plot) in this process: its stdout, no torch import."""
    from splitserve.cli import main
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(cmd[1:])
    except SystemExit as exc:          # --help exits 0, a usage error 2
        code = exc.code
    except Exception as exc:           # noqa: BLE001 -- reported like a failed subprocess
        raise StepFailed(f"{type(exc).__name__}: {exc}: {shown(cmd)}") from None
    if code not in (0, None):
        raise StepFailed(f"exit code {code}: {shown(cmd)}\n{_tail(err.getvalue())}")
    return out.getvalue()


def free_port(span: int = 1) -> int:
    """A port P with P .. P+span-1 free now (`splitserve up --port P` puts workers on P+1...),
    below Linux's ephemeral ports (32768+), so outgoing connections cannot take them meanwhile."""
    for port in random.sample(range(10000, 32768 - span), 100):
        socks = [socket.socket() for _ in range(span)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", port + i))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise StepFailed(f"found no {span} consecutive free ports")


def scrape(url: str) -> dict:
    """parse_prometheus(GET url/metrics)."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as r:
        return parse_prometheus(r.read())


class Service:
    """A server (`splitserve serve` / `splitserve up`) for the length of a `with` block:
    started in its own process group and healthy (/health 200) on entry; on exit SIGINT
    (which `splitserve up` answers by stopping its workers), then SIGKILL of the group in
    case anything is left."""

    def __init__(self, cmd: list[str], url: str, log: str, timeout: float):
        self.cmd, self.url, self.log_path, self.timeout = cmd, url, log, timeout

    def __enter__(self) -> "Service":
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        self.log = open(self.log_path, "w")
        self.log.write(f"$ {shown(self.cmd)}\n")
        self.log.flush()
        self.proc = subprocess.Popen(_argv(self.cmd), stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        t0 = time.monotonic()
        try:
            wait_healthy([self.proc], [self.url], self.timeout)
            print(f"# report: healthy after {time.monotonic() - t0:.1f} s", file=self.log,
                  flush=True)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            with open(self.log_path) as f:
                raise StepFailed(f"{exc}: {shown(self.cmd)}\n{_tail(f.read())}") from None
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:      # workers or engine processes of a leader that hung or died
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        print(f"# report: stopped in {time.monotonic() - t0:.1f} s", file=self.log, flush=True)
        self.log.close()


# -- the machine ------------------------------------------------------------------------------
def machine() -> dict:
    """nproc, CPU model, memory and the ISA flags that decide bfloat16 speed (/proc)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
        with open("/proc/meminfo") as f:
            fields["mem_kib"] = next(ln.split()[1] for ln in f if ln.startswith("MemTotal:"))
    except (OSError, StopIteration):
        pass
    flags = set(fields.get("flags", "").split())
    return {"nproc": os.cpu_count(), "cpu_model": fields.get("model name", "unknown CPU"),
            "memory_gib": int(fields.get("mem_kib", 0)) / (1 << 20),
            "isa": [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile",
                                "amx_bf16") if f in flags],
            "native_bf16": bool(flags & {"avx512_bf16", "amx_bf16"})}


def machine_line() -> str:
    m = machine()
    bf16 = "yes" if m["native_bf16"] else "no (no AVX512-BF16, no AMX)"
    return (f"{m['nproc']} cores ({m['cpu_model']}, {m['memory_gib']:.0f} GiB), ISA flags: "
            f"{', '.join(m['isa']) or 'no AVX2/AVX512'}; native bfloat16: {bf16}")


class LoadProbe:
    """How many cores processes other than the report's kept busy since construction (the
    VM is shared): the machine's CPU time (/proc/stat) minus the report's own, its reaped
    children's, and that of the live process groups of `services` (workers and engines)."""

    def __init__(self, *services: Service):
        self.services = services
        self.t0, self.machine0, self.own0 = time.monotonic(), _machine_cpu_s(), self._own_s()

    def _own_s(self) -> float:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return (time.process_time() + kids.ru_utime + kids.ru_stime
                + sum(_group_cpu_s(s.proc.pid) for s in self.services))

    def cores(self) -> float:
        other = (_machine_cpu_s() - self.machine0) - (self._own_s() - self.own0)
        return max(other, 0.0) / max(time.monotonic() - self.t0, 1e-9)


def _machine_cpu_s() -> float:
    with open("/proc/stat") as f:      # cpu  user nice system idle iowait irq softirq ...
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / _TICK


def _group_cpu_s(pgid: int) -> float:
    """CPU seconds of a process group's live members, and of the children they reaped."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += sum(map(int, fields[11:15]))     # utime stime cutime cstime
    return total / _TICK


def git_commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10).stdout
    try:
        commit = git("rev-parse", "--short", "HEAD").strip() or "unknown"
        dirty = git("status", "--porcelain", "--untracked-files=no").strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + (" (with uncommitted changes)" if dirty else "")


# -- the command ------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="a ~2 min smoke test, written under "
                   "bench-results/quick/ unless --out/--img-dir/--results-dir say otherwise")
    p.add_argument("--model", default=None, help="passed to every step (default: bundled)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="of the served workers (default: float32 unless bf16 is native)")
    p.add_argument("--out", default=None, help="the page (default docs/benchmarks.md)")
    p.add_argument("--img-dir", default=None, help="plots (default docs/img)")
    p.add_argument("--results-dir", default=None, help="step JSON and logs (default bench-results)")
    p.add_argument("--frontend-args", default="", help="extra arguments for `bench frontend`, "
                   "e.g. a smaller grid: '--isl 1k --concurrency 8'")
    p.add_argument("--start-timeout", type=float, default=300.0,
                   help="seconds a server may take to become healthy")
    p.set_defaults(func=run)     # `splitserve bench report` runs run(args)


def config_from_args(args) -> ReportConfig:
    base = "bench-results/quick" if args.quick else None
    return ReportConfig(
        quick=args.quick, model=args.model, dtype=args.dtype,
        out=args.out or (f"{base}/benchmarks.md" if base else "docs/benchmarks.md"),
        img_dir=args.img_dir or (f"{base}/img" if base else "docs/img"),
        results_dir=args.results_dir or base or "bench-results",
        frontend_args=tuple(shlex.split(args.frontend_args)), start_timeout=args.start_timeout,
        command=_command(args))


def _command(args) -> str:
    """The report's own command line, as the page cites it."""
    cmd = tool("bench", "report") + (["--quick"] if args.quick else [])
    for name in ("model", "dtype", "out", "img_dir", "results_dir", "frontend_args"):
        if getattr(args, name):
            cmd += [f"--{name.replace('_', '-')}", getattr(args, name)]
    return shown(cmd)


def run(args) -> int:
    from splitserve.bench import report_sections
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"splitserve bench report: {exc}") from None
    for folder in (os.path.dirname(os.path.abspath(cfg.out)), cfg.img_dir, cfg.results_dir):
        os.makedirs(folder, exist_ok=True)
    t0, whole, sections = time.monotonic(), LoadProbe(), []
    for title, build in report_sections.SECTIONS:
        print(f"== {title}", file=sys.stderr, flush=True)
        started, probe = time.monotonic(), LoadProbe()
        try:
            section = build(cfg)
        except Exception as exc:   # noqa: BLE001 -- a failed section is reported, not fatal
            section = Section(title, failed(exc))
        section.body += (f"\n\n_This section took {time.monotonic() - started:.0f} s; other "
                         f"processes kept {probe.cores():.1f} cores busy meanwhile._")
        sections.append(section)
    elapsed = time.monotonic() - t0
    sections.append(report_sections.howto(cfg, elapsed))
    page = report_sections.header(cfg, sections, whole.cores()) + "".join(
        f"\n## {s.title}\n\n{s.body.strip()}\n" for s in sections)
    with open(cfg.out, "w") as f:
        f.write(page)
    print(f"wrote {cfg.out} in {elapsed / 60:.1f} min", file=sys.stderr)
    return 0
