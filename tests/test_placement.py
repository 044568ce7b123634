"""CPU plans (splitserve/placement.py) and a real `serve` process placed by them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from splitserve.bench.server_process import ServerProcess, free_port
from splitserve.cli import build_parser
from splitserve.placement import (WorkerPlan, format_cpus, parse_cpus, pin_process,
                                  plan_cluster, plan_worker, usable_cpus)
from server_utils import engine_pid, post


def test_worker_plan_reserves_the_first_cpu_for_the_front_end():
    assert plan_worker((0,)) == WorkerPlan((0,), 1, (0,))         # nothing to spare: shared
    assert plan_worker((0, 1)) == WorkerPlan((1,), 1, (0,))
    assert plan_worker((0, 1, 2, 3)) == WorkerPlan((1, 2, 3), 3, (0,))
    sixteen = plan_worker(tuple(range(16)))
    assert sixteen == WorkerPlan(tuple(range(1, 16)), 15, (0,))


def test_worker_plan_follows_a_mask_that_is_not_0_to_n():
    assert plan_worker((9, 3, 5, 12)) == WorkerPlan((5, 9, 12), 3, (3,))
    assert plan_worker((7,)) == WorkerPlan((7,), 1, (7,))
    assert plan_worker((4, 6)) == WorkerPlan((6,), 1, (4,))


def test_threads_cpus_and_frontend_cpus_override():
    usable = (0, 1, 2, 3)
    # Fewer threads: that many engine CPUs; the front-end gets every other.
    assert plan_worker(usable, threads=2) == WorkerPlan((1, 2), 2, (0, 3))
    # As many threads as CPUs: nothing is reserved, nothing narrowed.
    assert plan_worker(usable, threads=4) == WorkerPlan(usable, 4, usable)
    assert plan_worker((0, 1), threads=2) == WorkerPlan((0, 1), 2, (0, 1))
    assert plan_worker(usable, engine_cpus=(2, 3)) == WorkerPlan((2, 3), 2, (0, 1))
    assert plan_worker(usable, threads=1, engine_cpus=(2, 3)) == WorkerPlan((2, 3), 1, (0, 1))
    assert plan_worker(usable, engine_cpus=usable) == WorkerPlan(usable, 4, usable)
    assert plan_worker(usable, frontend_cpus=(0, 1)) == WorkerPlan((1, 2, 3), 3, (0, 1))
    with pytest.raises(ValueError, match="threads"):
        plan_worker(usable, threads=0)


def test_cluster_plan_gives_each_engine_cpus_of_its_own():
    one = plan_cluster((0,), 2)
    assert one.workers == (WorkerPlan((0,), 1, (0,)),) * 2 and one.orchestrator_cpus == (0,)
    two = plan_cluster((0, 1), 2)     # CTX and GEN engines apart; front-ends float
    assert two.workers == (WorkerPlan((0,), 1, (0, 1)), WorkerPlan((1,), 1, (0, 1)))
    assert two.orchestrator_cpus == (0, 1)
    four = plan_cluster((0, 1, 2, 3), 2)   # the CTX engine takes the odd CPU
    assert four.workers == (WorkerPlan((1, 2), 2, (0,)), WorkerPlan((3,), 1, (0,)))
    assert four.orchestrator_cpus == (0,)
    sixteen = plan_cluster(tuple(range(16)), 3)
    assert [w.engine_cpus for w in sixteen.workers] == [tuple(range(1, 6)), tuple(range(6, 11)),
                                                         tuple(range(11, 16))]
    assert {w.frontend_cpus for w in sixteen.workers} == {(0,)}
    three_on_two = plan_cluster((4, 8), 3, threads=2)
    assert [w.engine_cpus for w in three_on_two.workers] == [(4,), (8,), (4,)]
    assert {w.engine_threads for w in three_on_two.workers} == {2}
    assert plan_cluster((2, 5, 7), 2).workers == (WorkerPlan((5,), 1, (2,)),
                                                   WorkerPlan((7,), 1, (2,)))


def test_one_thread_engines_borrow_a_front_end_cpu_unless_a_quota_makes_it_costly(
        monkeypatch, tmp_path):
    import splitserve.placement as placement
    read_quota = placement.cpu_quota
    monkeypatch.setattr(placement, "cpu_quota", lambda: None)
    assert plan_worker((0, 1)).helper_cpu == 0
    assert plan_worker((0,)).helper_cpu is None                 # no CPU but the engine's
    assert plan_worker((0, 1, 2, 3)).helper_cpu is None         # 3 threads: oneDNN's, no C pool
    assert [w.helper_cpu for w in plan_cluster((0, 1), 2).workers] == [1, 0]
    assert [w.helper_cpu for w in plan_cluster((0, 1, 2, 3), 2).workers] == [None, 0]
    monkeypatch.setattr(placement, "cpu_quota", lambda: 1.5)    # a container limited to 1.5 CPUs
    assert plan_worker((0, 1)).helper_cpu is None
    monkeypatch.setattr(placement, "cpu_quota", lambda: 2.0)
    assert plan_worker((0, 1)).helper_cpu == 0

    (tmp_path / "cpu.max").write_text("max 100000\n")          # cgroup v2
    assert read_quota(str(tmp_path)) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert read_quota(str(tmp_path)) == 1.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert read_quota(str(v1)) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    assert read_quota(str(v1)) == 3.0
    (tmp_path / "cpu.max").write_text("garbage\n")
    assert read_quota(str(tmp_path)) is None


def test_plans_fit_a_cpu_quota(monkeypatch, tmp_path):
    """A container limited to fewer CPUs than its affinity mask holds plans for the quota:
    ceil(quota) CPUs, so the engine gets a thread per CPU it can pay for."""
    import splitserve.placement as placement
    monkeypatch.setattr(placement.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert len(usable_cpus(str(tmp_path))) == 64                # no cgroup files: no quota
    (tmp_path / "cpu.max").write_text("200000 100000\n")
    assert usable_cpus(str(tmp_path)) == (0, 1)
    plan = plan_worker(usable_cpus(str(tmp_path)))
    assert (plan.engine_threads, plan.engine_cpus, plan.frontend_cpus) == (1, (1,), (0,))
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert plan_worker(usable_cpus(str(tmp_path))).engine_threads == 2
    (tmp_path / "cpu.max").write_text("50000 100000\n")       # half a CPU: one to share
    assert usable_cpus(str(tmp_path)) == (0,)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert len(usable_cpus(str(tmp_path))) == 64


def test_cpu_lists_parse_and_format():
    assert parse_cpus("0,2-4, 7") == (0, 2, 3, 4, 7)
    assert format_cpus((7, 0, 2, 3, 4)) == "0,2-4,7"
    assert parse_cpus(format_cpus((1, 3, 4, 5, 9))) == (1, 3, 4, 5, 9)
    for bad in ("", "a", "3-1", "-1", "1,,2"):
        with pytest.raises(ValueError, match="CPU list"):
            parse_cpus(bad)


def test_serve_flags_parse_and_refuse_bad_lists(capsys):
    args = build_parser().parse_args(["serve", "--cpus", "1-2", "--frontend-cpus", "0",
                                      "--threads", "2"])
    assert (args.cpus, args.frontend_cpus, args.threads) == ((1, 2), (0,), 2)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--cpus", "two"])
    assert "--cpus" in capsys.readouterr().err


def test_pin_process_names_cpus_it_cannot_use():
    with pytest.raises(RuntimeError, match="front-end: cannot run on CPUs 100000"):
        pin_process((100000,), "front-end")


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
