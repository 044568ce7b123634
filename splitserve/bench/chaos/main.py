"""`splitserve bench chaos`: a randomized fault campaign against a real cluster.

One cluster (`splitserve up`: several CTX and GEN workers, GEN workers with several
front-ends, a fleet of orchestrator processes) serves every schedule. First each request
of the pool (workload.py, drawn from --seed) that a schedule picks runs once without
faults: its clean text. Then each schedule K (its own generator, from seed and K, so
`--schedule K` replays it) sends its draw of the pool's requests at random moments while injecting faults
(faults.py: signals to processes, client disconnects, and KV transfer faults armed for the
CTX workers' KV transports) at random moments, and checks:

1. every request ended with its clean text, or with a clear error, within its deadline
   (one that broke when a fault ended an orchestrator process while it was open, or at
   most ACCEPT_GRACE before it started, is counted apart: that process held it);
2. once the requests are done, every worker's KV blocks are free and no lease is held
   (`splitserve_kv_blocks_used` + `splitserve_kv_blocks_leased` on /metrics), within the
   lease time plus the restarts' time;
3. every process the cluster should have runs and the orchestrator counts every worker
   healthy again.

Exit status 0 only if every check of every schedule held. The JSON result: seed,
schedules, requests, outcomes, errors (the clear errors clients got, by message),
faults_injected by kind, kv_faults_not_struck (armed, but no pull came for them before the
schedule's requests ended), violations (each with the seed and schedule that replay it),
seconds, shape, machine.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections import Counter

from splitserve.bench.chaos.cluster import ChaosCluster, Shape
from splitserve.bench.chaos.faults import (CLIENT_CUT, ENDS_CONNECTIONS, Schedule,
                                           draw_schedule, inject)
from splitserve.bench.chaos.workload import Call, request_pool
from splitserve.kv import faults as kv_faults

DEADLINE = 60.0          # seconds a request may take, faults included
SETTLE = 90.0            # seconds for KV to free and processes to come back after a schedule
# A connection accepted by an orchestrator process just before a fault ended it is lost
# with it (it sat in that process's accept queue): seconds before a request's start.
ACCEPT_GRACE = 2.0


def add_arguments(p) -> None:
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedules", type=int, default=10, help="schedules to run (default: "
                   "%(default)s)")
    p.add_argument("--schedule", type=int, default=None, metavar="K",
                   help="run schedule K of --seed only (replays a violation)")
    p.add_argument("--requests", type=int, default=8, help="requests per schedule")
    p.add_argument("--faults", type=int, default=3, help="at most this many faults per "
                   "schedule (at least one)")
    p.add_argument("--kv-faults", type=int, default=2, help="at most this many KV transfer "
                   "faults per schedule, besides --faults (0: none)")
    p.add_argument("--span", type=float, default=2.0, help="seconds over which a schedule's "
                   "requests start and its faults strike")
    p.add_argument("--num-ctx", type=int, default=Shape.num_ctx)
    p.add_argument("--num-gen", type=int, default=Shape.num_gen)
    p.add_argument("--gen-api-servers", type=int, default=Shape.gen_frontends)
    p.add_argument("--orchestrators", type=int, default=Shape.orchestrators)
    p.add_argument("--json", default=None, metavar="F", help="write the result here")
    p.add_argument("--log", default=None, help="the cluster's output (default: discarded)")


def run(args) -> int:
    shape = Shape(args.num_ctx, args.num_gen, args.gen_api_servers, args.orchestrators)
    indices = [args.schedule] if args.schedule is not None else range(args.schedules)
    started = time.monotonic()
    log = open(args.log, "w") if args.log else open(os.devnull, "w")
    cluster = ChaosCluster(shape, log)
    try:
        pool = request_pool(args.seed)
        schedules = {k: draw_schedule(args.seed, k, len(pool), args.requests, args.span,
                                      args.faults, args.kv_faults, shape.lease_seconds)
                     for k in indices}
        picked = sorted({i for s in schedules.values() for i in s.picks})
        clean = clean_texts(cluster, pool, picked)
        result = Campaign(args, cluster, pool, clean).run(schedules)
    finally:
        cluster.close()
        log.close()
    result |= {"seconds": round(time.monotonic() - started, 1), "shape": vars(shape),
               "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}"}
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text if len(text) < 4000 else json.dumps(
        {k: v for k, v in result.items() if k != "violations"} |
        {"violations": len(result["violations"])}, indent=2))
    return 0 if not result["violations"] else 1


def clean_texts(cluster: ChaosCluster, pool: list[dict],
                picked: list[int]) -> dict[int, list[str]]:
    """The text without faults of each picked request of the pool, one at a time."""
    texts = {}
    for i in picked:
        call = Call(cluster.port, pool[i], DEADLINE)
        call.start()
        out = call.join()
        if out.kind != "text":
            raise RuntimeError(f"request {i} of the pool failed without faults: {out.detail}")
        texts[i] = out.texts
    return texts


class Campaign:
    def __init__(self, args, cluster: ChaosCluster, pool: list[dict],
                 clean: dict[int, list[str]]):
        self.args, self.cluster, self.pool, self.clean = args, cluster, pool, clean
        self.faults: Counter = Counter()
        self.outcomes: Counter = Counter()
        self.errors: Counter = Counter()     # the clear errors clients got, by message
        self.violations: list[dict] = []
        self.kv_not_struck = 0               # KV faults armed that no pull came to take

    def run(self, schedules: dict[int, Schedule]) -> dict:
        for k, s in schedules.items():
            self.schedule(k, s)
        return {"seed": self.args.seed, "schedules": len(schedules),
                "requests": sum(self.outcomes.values()), "outcomes": dict(self.outcomes),
                "errors": dict(self.errors.most_common()),
                "faults_injected": dict(sorted(self.faults.items())),
                "kv_faults_not_struck": self.kv_not_struck,
                "violations": self.violations}

    def violation(self, k: int, what: str, **more) -> None:
        self.violations.append({"seed": self.args.seed, "schedule": k, "what": what, **more})
        print(f"chaos: seed {self.args.seed} schedule {k}: {what} {more or ''}",
              file=sys.stderr)

    def schedule(self, k: int, s: Schedule) -> None:
        calls = [Call(self.cluster.port, self.pool[i], DEADLINE) for i in s.picks]
        ended = self._play(k, calls, s.starts, s.faults)
        for call, i in zip(calls, s.picks):
            self._check_request(k, call, i, ended)
        struck, unused = kv_faults.collect(self.cluster.fault_dir)
        self.faults.update(struck)
        self.kv_not_struck += unused
        self._check_settled(k)

    def _play(self, k: int, calls: list[Call], starts: list[float],
              faults: list) -> list[float]:
        """Starts the calls and injects the faults, each at its moment (a KV fault is armed
        then and counted once a pull took it); the moments at which a fault ended an
        orchestrator process."""
        t0, ended = time.monotonic(), []
        events = sorted([(s, 0, c) for s, c in zip(starts, calls)] +
                        [(f.at, 1, f) for f in faults], key=lambda e: (e[0], e[1]))
        for at, is_fault, what in events:
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            if not is_fault:
                what.start()
            elif what.is_kv:
                kv_faults.arm(self.cluster.fault_dir, f"{k}-{at:.3f}-{what.kind}", what.kind,
                              what.pick, what.pause)
            elif what.kind == CLIENT_CUT:
                calls[int(what.pick * len(calls))].cut()
                self.faults[what.kind] += 1
            elif inject(what, self.cluster.processes()) is not None:
                self.faults[what.kind] += 1
                if what.target == "orchestrator" and what.signal_name in ENDS_CONNECTIONS:
                    ended.append(time.monotonic())
        return ended

    def _check_request(self, k: int, call: Call, i: int, orchestrator_ends: list[float]) -> None:
        out = call.join()
        kind = out.kind
        if kind == "broken" and any(out.started - ACCEPT_GRACE <= t <= out.ended
                                    for t in orchestrator_ends):
            kind = "lost_with_its_orchestrator"
        self.outcomes[kind] += 1
        if kind == "error":
            self.errors[out.detail] += 1
        elif kind == "text" and out.texts != self.clean[i]:
            self.violation(k, "text differs from the clean run's", request=i,
                           got=out.texts, want=self.clean[i])
        elif kind == "broken":
            self.violation(k, "no answer and no clear error", request=i, detail=out.detail)

    def _check_settled(self, k: int) -> None:
        deadline = time.monotonic() + SETTLE
        while time.monotonic() < deadline:
            missing, held = self.cluster.missing(), self.cluster.kv_held()
            if not missing and not held:
                return
            time.sleep(0.5)
        if missing:
            self.violation(k, "the cluster is not whole again", missing=missing)
        if held:
            self.violation(k, "KV blocks still held", held=held)
