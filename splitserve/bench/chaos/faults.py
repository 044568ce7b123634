"""Faults a chaos schedule injects, drawn from the seed, and how each is done.

A fault is a signal to one process of the cluster (by kind: orchestrator, ctx_worker,
gen_worker, ctx_engine, gen_engine, gen_frontend; which one of that kind is drawn too) or
a client that hangs up. SIGSTOP is always followed by SIGCONT after `pause` seconds, up
to PAUSE_MAX: longer than a chaos cluster's KV lease (3 s), so a context engine stopped
while a generation worker pulls from it may find its lease expired when it resumes.
SIGTERM of a worker is a worker that leaves (it deregisters and stops) and joins again
(`up` starts it again and it registers). KV transfer faults are not drawn: nothing in the
KV transport takes a fault plan from outside its process."""

from __future__ import annotations

import os
import random
import signal
import threading
from dataclasses import dataclass

TARGETS = ("orchestrator", "ctx_worker", "gen_worker", "ctx_engine", "gen_engine",
           "gen_frontend")
SIGNALS = ("SIGKILL", "SIGSTOP", "SIGTERM")
CLIENT_CUT = "client_disconnect"
# Signals that end a process: the client connections it held end with it.
ENDS_CONNECTIONS = ("SIGKILL", "SIGTERM")
PAUSE_MAX = 5.0


@dataclass(frozen=True)
class Fault:
    at: float                 # seconds after the schedule's first request
    kind: str                 # "<SIGNAL>:<target>" or client_disconnect
    pick: float               # which process of its kind (or which request), in [0, 1)
    pause: float = 0.0        # SIGSTOP: seconds until SIGCONT

    @property
    def signal_name(self) -> str:
        return self.kind.split(":")[0]

    @property
    def target(self) -> str:
        return self.kind.split(":")[1]


@dataclass(frozen=True)
class Schedule:
    """Schedule k of a seed: which pool requests it sends (picks), when each starts
    (starts, seconds, ascending), and its faults. A pure function of (seed, k, sizes)."""
    picks: list[int]
    starts: list[float]
    faults: list[Fault]


def draw_schedule(seed: int, k: int, pool_size: int, requests: int, span: float,
                  most_faults: int) -> Schedule:
    rng = random.Random(f"schedule:{seed}:{k}")
    picks = [rng.randrange(pool_size) for _ in range(requests)]
    starts = sorted(round(rng.uniform(0, span), 3) for _ in picks)
    return Schedule(picks, starts, draw_faults(rng, span, most_faults))


def draw_faults(rng: random.Random, span: float, most: int) -> list[Fault]:
    """1..most faults at random moments of the first `span` seconds, in time order."""
    faults = []
    for _ in range(rng.randint(1, most)):
        if rng.random() < 0.25:
            kind = CLIENT_CUT
        else:
            kind = f"{rng.choice(SIGNALS)}:{rng.choice(TARGETS)}"
        faults.append(Fault(round(rng.uniform(0, span), 3), kind, rng.random(),
                            round(rng.uniform(0.2, PAUSE_MAX), 3)))
    return sorted(faults, key=lambda f: f.at)


def inject(fault: Fault, processes: dict[str, list[int]]) -> int | None:
    """Sends the fault's signal to the process it picks (SIGCONT follows a SIGSTOP on a
    timer); its pid, or None when no process of that kind runs now (one that died and
    is not back yet)."""
    pids = sorted(processes.get(fault.target, []))
    if not pids:
        return None
    pid = pids[int(fault.pick * len(pids))]
    sig = getattr(signal, fault.signal_name)
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return None
    if sig == signal.SIGSTOP:
        timer = threading.Timer(fault.pause, _resume, (pid,))
        timer.daemon = True
        timer.start()
    return pid


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
