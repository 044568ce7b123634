"""The cluster a chaos campaign runs against: `splitserve up` in a subprocess, and the
processes it is made of, found from /proc (every one a descendant of `up`).

`up` is the supervisor under test: it restarts a worker (`serve`) that exits and a fleet
child that exits; a worker restarts its engine process and its front-ends. The campaign
only signals processes and reads what the cluster reports (/health, /metrics)."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from splitserve import envs
from splitserve.orchestrator.up import free_ports


@dataclass(frozen=True)
class Shape:
    """How many of each process the cluster should have."""
    num_ctx: int = 2
    num_gen: int = 2
    gen_frontends: int = 2
    orchestrators: int = 2
    lease_seconds: float = 3.0

    def up_args(self) -> list[str]:
        return ["--model", "tiny-random", "--threads", "1", "--kv-cache-gib", "0.05",
                "--num-ctx", str(self.num_ctx), "--num-gen", str(self.num_gen),
                "--gen-api-servers", str(self.gen_frontends),
                "--orchestrators", str(self.orchestrators),
                "--kv-lease-seconds", str(self.lease_seconds)]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def children(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task") if os.path.exists(f"/proc/{pid}/task") else ():
        kids += [int(k) for k in _read(f"/proc/{pid}/task/{task}/children").split()]
    return kids


def running(pid: int) -> bool:
    """Not gone and not a zombie."""
    stat = _read(f"/proc/{pid}/stat")
    return bool(stat) and stat.rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")


def listeners(port: int) -> set[int]:
    """The pids holding a socket that listens on 127.0.0.1:port."""
    inodes = set()
    for row in _read("/proc/net/tcp").splitlines()[1:]:
        cols = row.split()
        if cols[3] == b"0A" and int(cols[1].rsplit(b":", 1)[1], 16) == port:
            inodes.add(cols[9].decode())
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if any(link[8:-1] in inodes for link in links if link.startswith("socket:[")):
            found.add(int(pid))
    return found


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET", parts.path or "/")
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def worker_busy(url: str) -> float | None:
    """A worker's KV blocks in use plus those leased for a pull; None if it does not answer."""
    try:
        status, body = get(url + "/metrics")
    except (OSError, http.client.HTTPException):
        return None
    if status != 200:
        return None
    values = {}
    for line in body.decode().splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    try:
        return float(values["splitserve_kv_blocks_used"]) + float(
            values["splitserve_kv_blocks_leased"])
    except (KeyError, ValueError):
        return None


class ChaosCluster:
    """`up` started on free ports, whole (every worker joined) on return; close() kills
    everything it started, orphans included. Its KV transports take the faults armed in
    `fault_dir` (a directory of its own, removed on close)."""

    def __init__(self, shape: Shape, log, timeout: float = 300.0):
        self.shape = shape
        ports = free_ports(20000 + os.getpid() % 20000, 1)
        self.port = ports[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.fault_dir = tempfile.mkdtemp(prefix="splitserve-kv-faults-")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", "--log-level", "WARNING", "up",
             *shape.up_args(), "--port", str(self.port)], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=dict(os.environ, **{envs.KV_FAULTS: self.fault_dir}))
        if self.wait_whole(timeout):
            return
        self.close()
        raise RuntimeError(f"the cluster did not come up in {timeout:g} s")

    # -- who is who ---------------------------------------------------------------------
    def processes(self) -> dict[str, list[int]]:
        """The cluster's processes by kind: orchestrator, ctx_worker, gen_worker (a `serve`
        process), ctx_engine, gen_engine, gen_frontend (a front-end of several)."""
        out: dict[str, list[int]] = {k: [] for k in (
            "orchestrator", "ctx_worker", "gen_worker", "ctx_engine", "gen_engine",
            "gen_frontend")}
        for pid in children(self.proc.pid):
            cmd = _read(f"/proc/{pid}/cmdline").split(b"\0")
            if not running(pid):
                continue
            if b"--fleet-child" in cmd:
                out["orchestrator"].append(pid)
            elif b"serve" in cmd:
                role = cmd[cmd.index(b"--role") + 1].decode()
                port = int(cmd[cmd.index(b"--port") + 1])
                out[f"{role}_worker"].append(pid)
                self._worker_parts(pid, role, port, out)
        return out

    def _worker_parts(self, pid: int, role: str, port: int, out: dict) -> None:
        spawned = [k for k in children(pid) if running(k)
                   and b"spawn_main" in _read(f"/proc/{k}/cmdline")]
        frontends = listeners(port) if role == "gen" and self.shape.gen_frontends > 1 else set()
        for k in spawned:
            out[f"{role}_frontend" if k in frontends else f"{role}_engine"].append(k)

    def worker_urls(self) -> list[str]:
        n = self.shape.num_ctx + self.shape.num_gen
        return [f"http://127.0.0.1:{port}" for port in self._worker_ports(n)]

    def _worker_ports(self, n: int) -> list[int]:
        ports = []
        for pid in children(self.proc.pid):
            cmd = _read(f"/proc/{pid}/cmdline").split(b"\0")
            if b"serve" in cmd and b"--port" in cmd:
                ports.append(int(cmd[cmd.index(b"--port") + 1]))
        return sorted(set(ports))[:n]

    # -- health -------------------------------------------------------------------------
    def missing(self) -> list[str]:
        """What the cluster should have and does not serve now (empty: whole)."""
        s, gaps = self.shape, []
        procs = self.processes()
        want = {"orchestrator": s.orchestrators, "ctx_worker": s.num_ctx, "gen_worker": s.num_gen,
                "ctx_engine": s.num_ctx,
                "gen_engine": s.num_gen, "gen_frontend": s.num_gen * s.gen_frontends
                if s.gen_frontends > 1 else 0}
        gaps += [f"{kind}: {len(procs[kind])} of {n} running" for kind, n in want.items()
                 if len(procs[kind]) != n]
        try:
            status, body = get(self.url + "/health")
            healthy = json.loads(body).get("healthy", {}) if status == 200 else {}
        except (OSError, http.client.HTTPException, ValueError):
            status, healthy = 0, {}
        if status != 200:
            gaps.append(f"orchestrator /health answered {status or 'nothing'}")
        gaps += [f"orchestrator counts {len(healthy.get(role, []))} of {n} {role} healthy"
                 for role, n in (("ctx", s.num_ctx), ("gen", s.num_gen))
                 if status == 200 and len(healthy.get(role, [])) != n]
        return gaps

    def kv_held(self) -> dict[str, float | None]:
        """Workers whose KV blocks are not all free (None: /metrics did not answer)."""
        return {u: b for u in self.worker_urls() if (b := worker_busy(u)) != 0}

    def wait_whole(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            if not self.missing():
                return True
            time.sleep(0.3)
        return False

    def close(self) -> None:
        """SIGCONT first: a stopped process cannot stop itself."""
        family = self._all()
        for pid in family:
            _signal(pid, signal.SIGCONT)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in family:
            _signal(pid, signal.SIGKILL)
        shutil.rmtree(self.fault_dir, ignore_errors=True)

    def _all(self) -> list[int]:
        out, todo = [], [self.proc.pid]
        while todo:
            kids = children(todo.pop())
            out += kids
            todo += kids
        return out


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
