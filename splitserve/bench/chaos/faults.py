"""Faults a chaos schedule injects, drawn from the seed, and how each is done.

A fault is a signal to one process of the cluster (by kind: orchestrator, ctx_worker,
gen_worker, ctx_engine, gen_engine, gen_frontend; which one of that kind is drawn too) or
a client that hangs up. SIGSTOP is always followed by SIGCONT after `pause` seconds, up
to PAUSE_MAX: longer than a chaos cluster's KV lease (3 s), so a context engine stopped
while a generation worker pulls from it may find its lease expired when it resumes.
SIGTERM of a worker is a worker that leaves (it deregisters and stops) and joins again
(`up` starts it again and it registers).

A KV fault (kv/faults.py: a transfer cut mid-block, a delayed, duplicated or reordered
frame, a flipped bit, an answer that leaves after its lease expired) is armed in the
directory the cluster's KV transports read (SPLITSERVE_KV_FAULTS) at its moment, and
strikes the next pull any CTX answers. KV faults are drawn from a generator of their own
(seed, schedule), so adding them left each schedule's other faults as they were."""

from __future__ import annotations

import os
import random
import signal
import threading
from dataclasses import dataclass

from splitserve.kv.faults import KINDS as KV_KINDS

TARGETS = ("orchestrator", "ctx_worker", "gen_worker", "ctx_engine", "gen_engine",
           "gen_frontend")
SIGNALS = ("SIGKILL", "SIGSTOP", "SIGTERM")
CLIENT_CUT = "client_disconnect"
# Signals that end a process: the client connections it held end with it.
ENDS_CONNECTIONS = ("SIGKILL", "SIGTERM")
PAUSE_MAX = 5.0
DELAY_MAX = 2.0           # kv_delay: seconds an answer waits, at most
EXPIRY_MARGIN = 0.5       # kv_lease_expiry: seconds past the lease an answer waits


@dataclass(frozen=True)
class Fault:
    at: float                 # seconds after the schedule's first request
    kind: str                 # "<SIGNAL>:<target>" or client_disconnect
    pick: float               # which process of its kind (or which request), in [0, 1)
    pause: float = 0.0        # SIGSTOP: seconds until SIGCONT; a KV delay: its seconds

    @property
    def is_kv(self) -> bool:
        return self.kind in KV_KINDS

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
                  most_faults: int, most_kv_faults: int = 0, lease: float = 3.0) -> Schedule:
    rng = random.Random(f"schedule:{seed}:{k}")
    picks = [rng.randrange(pool_size) for _ in range(requests)]
    starts = sorted(round(rng.uniform(0, span), 3) for _ in picks)
    faults = draw_faults(rng, span, most_faults) + draw_kv_faults(
        random.Random(f"kv:{seed}:{k}"), span, most_kv_faults, lease)
    return Schedule(picks, starts, sorted(faults, key=lambda f: f.at))


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


def draw_kv_faults(rng: random.Random, span: float, most: int, lease: float) -> list[Fault]:
    """0..most KV faults at random moments of the first `span` seconds."""
    faults = []
    for _ in range(rng.randint(0, most)):
        kind, at, pick = rng.choice(KV_KINDS), round(rng.uniform(0, span), 3), rng.random()
        seconds = round(rng.uniform(0.2, DELAY_MAX), 3) if kind == "kv_delay" else 0.0
        faults.append(Fault(at, kind, pick, lease + EXPIRY_MARGIN if kind == "kv_lease_expiry"
                            else seconds))
    return faults


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
