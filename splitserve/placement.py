"""Which CPUs each process runs on, and how many torch threads an engine gets.

An engine's OpenMP threads wait for each other at the end of every parallel region, so one
thread that loses its core to the front-end, a client or another engine stalls the whole
step (docs/tuning.md has what it cost). So engines get CPUs of their own, one thread
per CPU, and the front-ends (and `up`'s orchestrator) get the CPUs left over, as vLLM does
(one CPU reserved for its front-end, the engine's threads bound to the rest).

Plans are built from the CPUs this process may run on (os.sched_getaffinity), so they hold
under taskset, in containers and in cgroups, on any core count; under a CPU quota (a
container's CPU limit) smaller than those, from only as many of them as the quota pays for.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

FRONTEND_RESERVE = 1   # CPUs kept for front-ends (and the orchestrator) when there are enough


@dataclass(frozen=True)
class WorkerPlan:
    engine_cpus: tuple[int, ...]
    engine_threads: int
    frontend_cpus: tuple[int, ...]

    @property
    def helper_cpu(self) -> int | None:
        """A one-thread engine's kernels borrow the idle time of the front-end's first CPU
        that is not the engine's (splitserve/model/native_pool.py), unless a CPU quota
        (a container's limit) is smaller than the CPUs: idle time there is not free, as
        what the helper uses counts against the quota the engine needs too."""
        spare = [c for c in self.frontend_cpus if c not in self.engine_cpus]
        if not spare or self.engine_threads != 1:
            return None
        quota = cpu_quota()
        cpus = set(self.engine_cpus) | set(self.frontend_cpus)
        return spare[0] if quota is None or quota >= len(cpus) else None

    def describe(self, frontends: int = 1) -> str:
        """frontends: front-end processes, which share the front-end CPUs. (Whether the
        engine borrows helper_cpu depends on its dtype, resolved in the engine process:
        its start line says.)"""
        who = "front-end" if frontends == 1 else f"{frontends} front-ends (shared)"
        return (f"engine {self.engine_threads} thread(s) on CPUs {format_cpus(self.engine_cpus)}, "
                f"{who} on CPUs {format_cpus(self.frontend_cpus)}")


@dataclass(frozen=True)
class ClusterPlan:
    workers: tuple[WorkerPlan, ...]      # in the order the workers are started (CTX first)
    orchestrator_cpus: tuple[int, ...]


def usable_cpus(root: str = "/sys/fs/cgroup") -> tuple[int, ...]:
    """The CPUs this process may run on; under a CPU quota smaller than their count, the
    first ceil(quota) of them. A container limited to 2 CPUs on a 64-CPU node sees all 64
    in its affinity mask, and an engine planned for 63 threads there would have most of
    them throttled mid-step while each parallel region waits for the last."""
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    quota = cpu_quota(root)
    if quota is not None and quota < len(cpus):
        cpus = cpus[:max(1, math.ceil(quota))]
    return cpus


def cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs' worth of time this process's cgroup may use (a container's CPU limit), or None
    when it has no quota. Reads cgroup v2's cpu.max, else v1's cpu.cfs_quota_us."""
    def read(*parts: str) -> str | None:
        try:
            with open(os.path.join(root, *parts)) as f:
                return f.read().strip()
        except OSError:
            return None
    try:
        v2 = read("cpu.max")
        if v2 is not None:
            quota, _, period = v2.partition(" ")
            return None if quota == "max" else int(quota) / int(period or 100000)
        quota, period = read("cpu", "cpu.cfs_quota_us"), read("cpu", "cpu.cfs_period_us")
        if quota is None or period is None or int(quota) < 0:
            return None
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):     # a file this code does not understand
        return None


def parse_cpus(text: str) -> tuple[int, ...]:
    """'0,2-3' -> (0, 2, 3); ValueError naming what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a CPU number or a range "
                             f"like 2-5") from None
        if first < 0 or last < first:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a valid range")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def cpu_list_argument(text: str) -> tuple[int, ...]:
    """parse_cpus for argparse, whose message then says what is wrong."""
    try:
        return parse_cpus(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def format_cpus(cpus: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> '0-2,5': the form parse_cpus reads."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def plan_worker(usable: tuple[int, ...], threads: int | None = None,
                engine_cpus: tuple[int, ...] | None = None,
                frontend_cpus: tuple[int, ...] | None = None) -> WorkerPlan:
    """One worker. Defaults: the front-end keeps the first usable CPU, the engine gets the
    others with a thread each (one CPU: both share it). `threads` alone picks that many CPUs
    for the engine, or all of them, unreserved, when it leaves none for the front-end;
    `engine_cpus` / `frontend_cpus` set the CPUs outright."""
    usable = tuple(sorted(usable))
    assert usable, "a process always has a CPU to run on"
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    if engine_cpus is None:
        engine_cpus = _engine_share(usable, threads)
    rest = tuple(c for c in usable if c not in engine_cpus)
    return WorkerPlan(tuple(engine_cpus), threads or len(engine_cpus),
                      tuple(frontend_cpus or rest or usable))


def _engine_share(usable: tuple[int, ...], threads: int | None) -> tuple[int, ...]:
    spare = len(usable) - FRONTEND_RESERVE
    if spare < 1:
        return usable
    if threads is None:
        return usable[FRONTEND_RESERVE:]
    return usable[FRONTEND_RESERVE:FRONTEND_RESERVE + threads] if threads <= spare else usable


def plan_cluster(usable: tuple[int, ...], num_workers: int,
                 threads: int | None = None) -> ClusterPlan:
    """`splitserve up`: each engine gets CPUs of its own (the first workers, the CTX ones,
    take the remainder: prefill uses threads, decode barely does). With a CPU to spare, the
    first is reserved for every front-end and the orchestrator; without, they float over all
    CPUs and engines get one CPU each, shared round-robin when workers outnumber CPUs."""
    usable = tuple(sorted(usable))
    assert num_workers >= 1
    if len(usable) <= num_workers:
        workers = [WorkerPlan((c,), threads or 1, usable)
                   for c in (usable[i % len(usable)] for i in range(num_workers))]
        return ClusterPlan(tuple(workers), usable)
    shared, pool = usable[:FRONTEND_RESERVE], usable[FRONTEND_RESERVE:]
    size, extra = divmod(len(pool), num_workers)
    workers, start = [], 0
    for i in range(num_workers):
        cpus = pool[start:start + size + (i < extra)]
        start += len(cpus)
        workers.append(WorkerPlan(cpus, threads or len(cpus), shared))
    return ClusterPlan(tuple(workers), shared)


def pin_process(cpus: tuple[int, ...], what: str) -> None:
    """Pins every thread this process has (sched_setaffinity on a pid moves one thread
    only) and, through inheritance, every thread it starts later."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except FileNotFoundError:   # no procfs: the calling thread at least
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:   # that thread ended meanwhile
            continue
        except OSError as exc:
            raise RuntimeError(f"{what}: cannot run on CPUs {format_cpus(cpus)} "
                               f"({exc.strerror}); this process may use CPUs "
                               f"{format_cpus(usable_cpus())}") from None
