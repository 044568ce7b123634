"""Start real worker processes for end-to-end tests and talk to them over HTTP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """`splitserve serve ...` in a subprocess; stopped (and waited for) on close()."""

    def __init__(self, *args: str, timeout: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, SPLITSERVE_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", "--log-level", "WARNING", "serve",
             "--port", str(self.port), *args], env=env)
        wait_healthy(self, timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_healthy(service, timeout: float) -> None:
    """Until service.url answers /health with 200; closes the service on failure."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service.proc.poll() is not None:
            raise RuntimeError(f"{service.url} exited with {service.proc.returncode}")
        try:
            if get(service.url + "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    service.close()
    raise TimeoutError(f"{service.url} did not become healthy")


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def post(url: str, body, timeout: float = 120) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream(url: str, body: dict, timeout: float = 120) -> list[dict | str]:
    """POST with stream: true; returns the parsed SSE events (the final '[DONE]' as a str)."""
    data = json.dumps({**body, "stream": True}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: "):
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def metrics(url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}."""
    out = {}
    for line in get(url + "/metrics")[1].decode().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


class Orchestrator:
    """`splitserve orchestrator -c cluster.yaml` in a subprocess."""

    def __init__(self, tmp_path, ctx_urls, gen_urls, ctx_router="round_robin",
                 gen_router="least_loaded", timeout: float = 60.0):
        import yaml
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = tmp_path / f"cluster-{self.port}.yaml"
        path.write_text(yaml.safe_dump({
            "port": self.port, "health_check_interval": 0.5,
            "context_servers": {"urls": list(ctx_urls), "router": ctx_router},
            "generation_servers": {"urls": list(gen_urls), "router": gen_router}}))
        self.proc = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "--log-level",
                                      "WARNING", "orchestrator", "-c", str(path)])
        wait_healthy(self, timeout)

    close = Worker.close


def descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in os.listdir(f"/proc/{p}/task") if os.path.exists(f"/proc/{p}/task") else ():
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                kids = []
            out.update(kids)
            todo.extend(kids)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def engine_pid(worker) -> int:
    """The worker's engine-core process (multiprocessing spawn child, not its resource tracker)."""
    for pid in descendants(worker.proc.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            return pid
    raise LookupError("no engine process found")
