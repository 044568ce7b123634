"""Start real worker processes for end-to-end tests and talk to them over HTTP."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
import urllib.error
import urllib.request

from splitserve.bench.server_process import ServerProcess, free_port
from splitserve.internal_client import InternalClient

# The internal secret of every process the tests start (they inherit this environment),
# as `splitserve up` would hand it to its workers. post() and stream() send the target's
# token (trust.py), so a test may play the orchestrator's part on a worker's own port;
# tests of what a public client may do send their own headers.
TEST_SECRET = os.environ.setdefault("SPLITSERVE_INTERNAL_SECRET", "test-internal-secret")
CLIENT = InternalClient(TEST_SECRET)


def internal(url: str) -> dict[str, str]:
    """The headers of an internal request to the server at url: its instance's token,
    learnt through the challenge on its /health (again after a 403: CLIENT.urlopen)."""
    return CLIENT.headers(url)


def _open(req: urllib.request.Request, timeout: float, internal_call: bool):
    if internal_call:
        return CLIENT.urlopen(req, timeout)
    return urllib.request.urlopen(req, timeout=timeout)


class Worker(ServerProcess):
    """`splitserve serve ...` (one torch thread) in a subprocess, healthy on return (unless
    wait is False); stopped (and waited for) on close()."""

    def __init__(self, *args: str, timeout: float = 180.0, wait: bool = True):
        port = free_port()
        super().__init__(["serve", "--port", str(port), *args], port, threads=1)
        if wait:
            wait_healthy(self, timeout)


def start_workers(*arg_lists: tuple[str, ...], timeout: float = 180.0) -> list[Worker]:
    """Workers started together, each healthy on return: their start-ups (imports, the
    model's load) overlap on the machine's cores. All are closed if one fails."""
    workers = [Worker(*args, wait=False) for args in arg_lists]
    try:
        for w in workers:
            w.wait_healthy(timeout)
    except BaseException:
        for w in workers:
            w.close()
        raise
    return workers


def wait_healthy(service: ServerProcess, timeout: float) -> None:
    """service.wait_healthy(timeout); closes the service on failure."""
    try:
        service.wait_healthy(timeout)
    except BaseException:
        service.close()
        raise


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def post(url: str, body, timeout: float = 120, headers: dict | None = None) -> tuple[int, dict]:
    """headers: instead of the target's internal token."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={
        "Content-Type": "application/json", **(headers or {})})
    try:
        with _open(req, timeout, headers is None) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def call(method: str, url: str, body=None, headers: dict | None = None) -> tuple[int, dict, dict]:
    """(status, JSON answer, response headers), sending only the headers given."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def assert_unauthorized(status: int, body: dict, headers: dict, message_start: str) -> None:
    """A 401 as OpenAI answers it (the key never echoed)."""
    assert status == 401, body
    assert headers.get("WWW-Authenticate") == "Bearer"
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert error["param"] is None and error["message"].startswith(message_start), error
    assert "sk-" not in error["message"]


def stream(url: str, body: dict, timeout: float = 120,
           headers: dict | None = None) -> list[dict | str]:
    """POST with stream: true; returns the parsed SSE events (the final '[DONE]' as a str).
    headers: instead of the target's internal token."""
    data = json.dumps({**body, "stream": True}).encode()
    req = urllib.request.Request(url, data=data, headers={
        "Content-Type": "application/json", **(headers or {})})
    events = []
    with _open(req, timeout, headers is None) as r:
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


class Orchestrator(ServerProcess):
    """`splitserve orchestrator -c cluster.yaml` in a subprocess, healthy on return."""

    def __init__(self, tmp_path, ctx_urls, gen_urls, ctx_router="round_robin",
                 gen_router="least_loaded", timeout: float = 60.0, healthy: bool = True,
                 **config):
        """config: more ClusterConfig fields (max_in_flight, idle_timeout, ...). healthy:
        False returns once it answers /health, whatever it says."""
        import yaml
        port = free_port()
        path = tmp_path / f"cluster-{port}.yaml"
        path.write_text(yaml.safe_dump({
            "port": port, "health_check_interval": 0.5, "internal_secret": TEST_SECRET,
            **config,
            "context_servers": {"urls": list(ctx_urls), "router": ctx_router},
            "generation_servers": {"urls": list(gen_urls), "router": gen_router}}))
        super().__init__(["orchestrator", "-c", str(path)], port)
        if healthy:
            wait_healthy(self, timeout)
        else:
            wait_for(lambda: _answers(self.url), timeout, "the orchestrator listening")


def _answers(url: str) -> bool:
    try:
        get(url + "/health")
        return True
    except (OSError, http.client.HTTPException):
        return False


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
    """Whether any thread of process `pid` still runs. Not the leader's state alone: a
    killed multi-threaded process's leader turns zombie while its other threads are still
    exiting, and the last of them closes its files (a listening socket still takes
    connections until then, and resets them when it closes)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return True
        except OSError:
            pass
    return False


def engine_pid(worker) -> int:
    """The worker's engine-core process (multiprocessing spawn child, not its resource tracker)."""
    for pid in descendants(worker.proc.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            return pid
    raise LookupError("no engine process found")


def kv_blocks_busy(url: str) -> float:
    """A worker's KV blocks in use plus those leased to generation workers."""
    m = metrics(url)
    return m["splitserve_kv_blocks_used"] + m["splitserve_kv_blocks_leased"]


def wait_kv_free(urls, timeout: float = 30.0) -> None:
    """Until every worker's KV blocks are free again (a lease nobody pulls expires)."""
    deadline = time.monotonic() + timeout
    while busy := {u: kv_blocks_busy(u) for u in urls if kv_blocks_busy(u)}:
        assert time.monotonic() < deadline, f"KV blocks still held after {timeout} s: {busy}"
        time.sleep(0.2)


def wait_for(cond, timeout: float, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not met in {timeout} s"
        time.sleep(0.2)


def answers_health(url: str) -> bool:
    try:
        return get(url + "/health")[0] == 200
    except (OSError, http.client.HTTPException):   # (up.wait_healthy says when)
        return False


class UpCluster:
    """`splitserve up <args>` in a subprocess on a free port (its output to `log`, a path,
    if given), healthy on return; interrupt() is Ctrl-C, close() kills what is left."""

    def __init__(self, *args: str, log=None, log_level: str = "WARNING", timeout: float = 180.0):
        import subprocess
        import sys
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        out = open(log, "w") if log else None
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "splitserve.cli", "--log-level", log_level, "up", *args,
                 "--port", str(self.port), "--threads", "1"], stdout=out, stderr=out and -2)
        finally:
            if out:
                out.close()
        # up's workers register as each comes up; the cluster is whole once all have joined
        want = {role: int(args[args.index(flag) + 1]) if flag in args else 1
                for role, flag in (("ctx", "--num-ctx"), ("gen", "--num-gen"))}
        try:
            wait_for(lambda: answers_health(self.url) and self.joined() == want, timeout,
                     "cluster health")
        except BaseException:
            self.close()
            raise

    def joined(self) -> dict[str, int]:
        """How many workers of each role the orchestrator counts healthy."""
        healthy = json.loads(get(self.url + "/health")[1])["healthy"]
        return {role: len(healthy[role]) for role in ("ctx", "gen")}

    def interrupt(self) -> None:
        """Ctrl-C: `up` exits 0 and every process it started is gone."""
        import signal
        family = descendants(self.proc.pid)
        self.proc.send_signal(signal.SIGINT)
        assert self.proc.wait(60) == 0
        wait_for(lambda: not any(alive(p) for p in family), 30, "every process gone")

    def close(self) -> None:
        # Workers outlive a SIGKILLed `up`: kill them too, or they hold their ports and
        # CPUs for the rest of the run.
        family = descendants(self.proc.pid) if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in family:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def logged_up(tmp_path_factory, name: str):
    """A module fixture's body (`yield from`): `up` of tiny-random in float32 (greedy is
    exact) logging at INFO to a file; yields (cluster, the log's path)."""
    log = tmp_path_factory.mktemp(name) / "up.log"
    cluster = UpCluster("--model", "tiny-random", "--dtype", "float32", log=log,
                        log_level="INFO")
    try:
        yield cluster, log
    finally:
        cluster.close()


def memory_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, in kB."""
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) for k, _, v in (ln.partition(":") for ln in f)
                if k in ("VmRSS", "VmHWM")}


def send_unasked_body(url: str, path: str, size: int, expect: bool = False,
                      headers: str = "") -> tuple[bytes, int]:
    """POST a `size`-byte body without an API key, reading while sending: -> (the first
    line the server answers, body bytes sent before it). With `expect`, the body waits for
    the server's word (Expect: 100-continue) and nothing of it is sent."""
    import select
    import socket
    from urllib.parse import urlsplit
    u = urlsplit(url)
    if expect:
        headers += "Expect: 100-continue\r\n"
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {size}\r\n{headers}\r\n".encode())
    chunk, sent = b"x" * (1 << 20), 0
    try:
        while not select.select([sock], [], [], 0 if sent < size and not expect else 30)[0]:
            sock.sendall(chunk[:size - sent])
            sent += min(len(chunk), size - sent)
        return sock.recv(4096).split(b"\r\n", 1)[0], sent
    finally:
        sock.close()


def unasked_bodies_held_kb(url: str, pid: int, paths: list[str],
                           size: int = 64 << 20) -> tuple[set[bytes], int, int]:
    """One keyless `size`-byte body to paths[0], then one to each path at once: -> (the
    status lines answered, the server's peak memory growth in kB after the one, after all
    of them)."""
    from concurrent.futures import ThreadPoolExecutor
    before = memory_kb(pid)["VmHWM"]
    lines = {send_unasked_body(url, paths[0], size)[0]}
    one = memory_kb(pid)["VmHWM"]
    with ThreadPoolExecutor(len(paths)) as pool:
        lines |= {line for line, _ in pool.map(lambda p: send_unasked_body(url, p, size), paths)}
    return lines, one - before, memory_kb(pid)["VmHWM"] - one
