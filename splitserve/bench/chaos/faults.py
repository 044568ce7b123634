"""Faults a chaos schedule injects, drawn from the seed, and how each is done.

A fault is a signal to one process of the cluster (by kind: orchestrator, ctx_worker,
gen_worker, ctx_engine, gen_engine, gen_frontend; which one of that kind is drawn too) or
a client that hangs up. SIGSTOP is always followed by SIGCONT after `pause` seconds.
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


def draw_faults(rng: random.Random, span: float, most: int) -> list[Fault]:
    """1..most faults at random moments of the first `span` seconds, in time order."""
    faults = []
    for _ in range(rng.randint(1, most)):
        if rng.random() < 0.25:
            kind = CLIENT_CUT
        else:
            kind = f"{rng.choice(SIGNALS)}:{rng.choice(TARGETS)}"
        faults.append(Fault(round(rng.uniform(0, span), 3), kind, rng.random(),
                            round(rng.uniform(0.2, 2.0), 3)))
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
