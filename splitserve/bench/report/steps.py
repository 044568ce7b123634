"""The steps of `splitserve bench report`: the real tools as subprocesses (or, for quick
ones, in this process), the servers they measure for the length of a `with` block, and
the JSON they write. A step that fails raises StepFailed with the tail of its output."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from splitserve.bench.report.config import ReportConfig
from splitserve.bench.report.machine import live_in_group
from splitserve.bench.report.markdown import failed, shown
from splitserve.orchestrator.up import wait_healthy
from splitserve.prometheus import parse_prometheus


class StepFailed(Exception):
    pass


STEP_ERRORS = (StepFailed, OSError, ValueError, KeyError)
GONE_S = 30.0      # how long a stopped server's killed processes may take to disappear


def tool(*args: str) -> list[str]:
    """A splitserve command line as the page cites it."""
    return ["splitserve", *args]


def _argv(cmd: list[str]) -> list[str]:
    # The report's own interpreter and checkout, whatever `splitserve` is first on PATH.
    if cmd[0] == "env":               # `env VAR=value ... splitserve ...`
        n = next(i for i, a in enumerate(cmd[1:], 1) if "=" not in a)
        return [*cmd[:n], *_argv(cmd[n:])]
    if cmd[0] != "splitserve":        # another server (reference.py's vLLM), as given
        return cmd
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


def scrape(url: str) -> dict:
    """parse_prometheus(GET url/metrics)."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as r:
        return parse_prometheus(r.read())


class Service:
    """A server (`splitserve serve` / `splitserve up`) for the length of a `with` block:
    started in its own process group and healthy (/health 200) on entry (`started_s`: how
    long that took); on exit SIGINT (which `splitserve up` answers by stopping its workers),
    then SIGKILL of the group in case anything is left, and a wait (up to GONE_S) until no
    process of the group is left, so the next server starts on a machine they have left."""

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
            self.started_s = time.monotonic() - t0
            print(f"# report: healthy after {self.started_s:.1f} s", file=self.log, flush=True)
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
        while live_in_group(self.proc.pid) and time.monotonic() - t0 < GONE_S:
            time.sleep(0.1)
        print(f"# report: stopped in {time.monotonic() - t0:.1f} s", file=self.log, flush=True)
        self.log.close()


def load_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def plot_step(cfg: ReportConfig, paths: list[str], name: str) -> tuple[list[str], str]:
    """`splitserve bench plot` over result files: (its command, markdown images)."""
    if not paths:
        return [], "(no plots: no run succeeded)"
    cmd = tool("bench", "plot", *paths, "--out", cfg.img(name))
    try:
        out = run_inprocess(cmd)
    except StepFailed as exc:
        return [cmd], failed(exc)
    pngs = [line.strip() for line in out.splitlines() if line.strip().endswith(".png")]
    return [cmd], "\n\n".join(f"![{os.path.basename(p)}]({cfg.link(p)})" for p in pngs)
