"""Real `serve`, `up` and `bench engine` processes placed by the CPU plans (splitserve/placement.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace


from splitserve.bench.server_process import ServerProcess, free_port
from splitserve.placement import (WorkerPlan, format_cpus, plan_cluster, plan_worker,
                                  usable_cpus)
from server_utils import engine_pid, post


def _threads(pid: int) -> dict[int, str]:
    """tid -> name of each thread of a process."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except FileNotFoundError:
            pass
    return out


def _affinity(pid: int) -> set[tuple[int, ...]]:
    """The CPUs each thread of a process may run on, but the kernels' helper's."""
    out = set()
    for tid, name in _threads(pid).items():
        try:
            if name != "kernel-helper":
                out.add(tuple(sorted(os.sched_getaffinity(tid))))
        except ProcessLookupError:
            pass
    return out


def _helpers(pid: int) -> list[tuple[tuple[int, ...], int]]:
    """(CPUs, scheduling policy) of each kernels' helper thread of a process."""
    return [(tuple(sorted(os.sched_getaffinity(tid))), os.sched_getscheduler(tid))
            for tid, name in _threads(pid).items() if name == "kernel-helper"]


class _Serve(ServerProcess):
    """`splitserve serve --model tiny-random ...` at INFO, its log captured."""

    def __init__(self, tmp_path, *args: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / f"serve-{self.port}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "splitserve.cli", "--log-level", "INFO", "serve",
                 "--model", "tiny-random",
                 "--port", str(self.port), *args], stdout=out, stderr=subprocess.STDOUT,
                env=dict(os.environ, **(env or {})))

    def wait_serving(self, timeout: float = 300.0) -> str:
        """The log once the worker says it serves."""
        import time
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log.read_text()
            if "serving tiny-random" in text:
                return text
            assert self.proc.poll() is None, f"serve exited:\n{text}"
            time.sleep(0.3)
        raise TimeoutError(f"serve did not start in {timeout:.0f} s:\n{self.log.read_text()}")


def _check_placed(server: _Serve, plan: WorkerPlan, dtype: str) -> None:
    log = server.wait_serving()
    # A request runs the model, so torch's OpenMP threads exist when affinities are read.
    status, _ = post(server.url + "/v1/completions", {"prompt": "hello", "max_tokens": 4})
    assert status == 200
    line = next(x for x in log.splitlines() if "front-end on CPUs" in x)
    assert plan.describe() in line
    assert re.search(rf"serving tiny-random \({dtype}\) on http", log), log
    engine = engine_pid(server)
    assert _affinity(engine) == {plan.engine_cpus}
    assert _affinity(server.proc.pid) == {plan.frontend_cpus}
    threads = re.search(r"engine: (\w+) on cpu, (\d+) torch thread\(s\) on CPUs ([\d,-]+), "
                        r"(C kernels for -march=\w+|PyTorch kernels)", log)
    assert threads, log
    assert threads.groups()[:3] == (dtype, str(plan.engine_threads),
                                    format_cpus(plan.engine_cpus))
    helper = plan.helper_cpu if dtype == "float32" and "C kernels" in threads.group(4) else None
    if helper is None:
        assert not _helpers(engine) and "idle time" not in log
    else:   # the kernels borrow the front-end's CPU, only when nothing else wants it
        assert _helpers(engine) == [((helper,), os.SCHED_IDLE)]
        assert f"kernels borrow CPU {helper}'s idle time" in log


def test_serve_places_engine_and_front_end_by_default(tmp_path):
    server = _Serve(tmp_path, "--dtype", "float32", env={"SPLITSERVE_NUM_THREADS": "",
                                                         "SPLITSERVE_ENGINE_CPUS": ""})
    try:
        _check_placed(server, plan_worker(usable_cpus()), "float32")
    finally:
        server.close()


def test_serve_overrides_reach_the_engine_and_auto_dtype_is_resolved(tmp_path):
    last = usable_cpus()[-1]
    server = _Serve(tmp_path, "--cpus", str(last), env={"SPLITSERVE_NUM_THREADS": "2"})
    try:
        log = server.wait_serving()
        dtype = re.search(r"dtype auto -> (\w+)", log).group(1)
        _check_placed(server, plan_worker(usable_cpus(), 2, (last,)), dtype)
    finally:
        server.close()


def test_up_places_ctx_gen_and_orchestrator_by_the_cluster_plan(tmp_path):
    from server_utils import UpCluster, descendants
    plan = plan_cluster(usable_cpus(), 2, threads=1)    # UpCluster passes --threads 1
    cluster = UpCluster("--model", "tiny-random", "--dtype", "float32",
                        log=tmp_path / "up.log", log_level="INFO")
    family: set[int] = set()
    try:
        assert post(cluster.url + "/v1/completions", {"prompt": "hi", "max_tokens": 4})[0] == 200
        family = descendants(cluster.proc.pid)
        workers = {}
        for pid in family:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            if b"--role" in cmd:
                workers[cmd[cmd.index(b"--role") + 1].decode()] = pid
        assert set(workers) == {"ctx", "gen"}
        for role, expected in zip(("ctx", "gen"), plan.workers):
            engine = engine_pid(SimpleNamespace(proc=SimpleNamespace(pid=workers[role])))
            assert _affinity(engine) == {expected.engine_cpus}, role
            assert _affinity(workers[role]) == {expected.frontend_cpus}, role
        assert _affinity(cluster.proc.pid) == {plan.orchestrator_cpus}
    finally:
        family |= descendants(cluster.proc.pid)
        cluster.close()
        for pid in family:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def test_bench_engine_runs_on_the_cpus_it_is_given(tmp_path):
    import json
    last, out = usable_cpus()[-1], tmp_path / "engine.json"
    subprocess.run([sys.executable, "-m", "splitserve.cli", "bench", "engine", "--model",
                    "tiny-random", "--dtype", "float32", "--cpus", str(last), "--threads", "1",
                    "--prefill-len", "16", "--repeats", "1", "--batch-sizes", "1",
                    "--decode-steps", "2", "--json", str(out)], check=True, timeout=300)
    result = json.loads(out.read_text())
    assert (result["cpus"], result["torch_threads"]) == (str(last), 1)
