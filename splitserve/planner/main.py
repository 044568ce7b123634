"""The planner's loop: every `interval` seconds, read the members from the orchestrator and
each member's /metrics (internal requests: the cluster's secret), decide (policy.py), and
carry out a move (POST /internal/workers/role). Every move is logged at INFO with the
numbers behind it; a hold is logged when its reason changes. /metrics counts both.

Where the planner may start and stop workers, the process that started it (`up`) gave it
a pipe (envs.planner_scale_fd): it asks there, one JSON line each,
{"add": "ctx"|"gen"} or {"retire": url}, and `up` carries it out (orchestrator/up.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import urllib.request

import orjson

from splitserve import envs
from splitserve.httpd import HTTPServer, Request, Response
from splitserve.httpd.connections import Standing
from splitserve.httpd.router import NO_BODY, Route, Router
from splitserve.httpd.server import Admission
from splitserve.internal_client import InternalClient
from splitserve.metrics import Counter, Gauge, Registry
from splitserve.planner.config import PlannerConfig
from splitserve.planner.policy import Decision, PoolView, Scaling, decide
from splitserve.planner.window import Sample, Window, read_sample
from splitserve.protocol.internal_api import WORKERS_PATH, WORKERS_ROLE_PATH
from splitserve.protocol.openai import status_error_body
from splitserve.protocol.roles import REGISTERED_ROLE
from splitserve.signals import wait_for_stop_signal

logger = logging.getLogger(__name__)

TIMEOUT = 5.0                     # seconds for one internal request
CHANGE_TIMEOUT = 300.0            # seconds an added worker may take to join, a retired one
                                  # to leave, before the planner stops waiting for it
MAX_METRICS_BYTES = 4 << 20       # a worker's /metrics read at most


class PlannerMetrics:
    def __init__(self):
        self.registry = r = Registry()
        p = "splitserve_planner_"
        self.moves = r.register(Counter(p + "moves_total", "Workers moved between pools",
                                        ("from", "to")))
        self.holds = r.register(Counter(p + "holds_total", "Looks that moved no worker, by "
                                        "reason", ("reason",)))
        self.errors = r.register(Counter(p + "errors_total", "Looks or moves that failed, by "
                                         "what failed", ("what",)))
        self.p90 = r.register(Gauge(p + "p90_seconds", "The window's p90: ttft of the "
                                    "context pool, itl of the generation pool", ("signal",)))
        self.workers = r.register(Gauge(p + "pool_workers", "Workers in each pool", ("pool",)))
        self.scaled = r.register(Counter(p + "scaled_total", "Workers the planner asked to "
                                         "start (add) or stop (retire), by pool",
                                         ("action", "pool")))


class Planner:
    def __init__(self, config: PlannerConfig, secret: str, scale_fd: int | None = None):
        self.config = config
        # Where it may start and stop workers: the pipe to the process that does.
        self.scale_fd = scale_fd if config.max_workers is not None else None
        self.scaling = (Scaling(config.max_workers, config.scale_down_below)
                        if self.scale_fd is not None else None)
        self.orchestrator = config.orchestrator.rstrip("/")
        self.client = InternalClient(secret)
        self.window = Window(config.window)
        self.metrics = PlannerMetrics()
        self.last_move = -float("inf")
        self.last_reason: str | None = None
        self.reachable = True
        # An add or retire asked for and not yet seen: (the member count it makes, until when)
        self.pending: tuple[int, float] | None = None

    # -- the cluster, over HTTP (blocking: called on a thread) ---------------------------
    def _call(self, url: str, body: dict | None = None) -> bytes:
        data = None if body is None else orjson.dumps(body)
        request = urllib.request.Request(url, data, method="GET" if data is None else "POST",
                                         headers={"Content-Type": "application/json"})
        with self.client.urlopen(request, timeout=TIMEOUT) as r:
            return r.read(MAX_METRICS_BYTES)

    def members(self) -> list[dict]:
        return orjson.loads(self._call(self.orchestrator + WORKERS_PATH))["data"]

    def scrape(self, url: str) -> Sample | None:
        try:
            return read_sample(self._call(url + "/metrics"))
        except (OSError, ValueError) as exc:
            logger.debug("planner: %s/metrics: %s", url, exc)
            self.metrics.errors.labels("scrape").inc()
            return None

    def move(self, url: str, pool: str) -> bool:
        try:
            self._call(self.orchestrator + WORKERS_ROLE_PATH,
                       {"url": url, "role": REGISTERED_ROLE[pool]})
            return True
        except OSError as exc:
            logger.warning("planner: moving %s to the %s pool failed: %s", url, pool, exc)
            self.metrics.errors.labels("move").inc()
            return False

    def ask(self, request: dict) -> bool:
        """One line to the process that starts and stops workers."""
        try:
            os.write(self.scale_fd, orjson.dumps(request) + b"\n")
            return True
        except OSError as exc:
            logger.warning("planner: asking for %s failed: %s", request, exc)
            self.metrics.errors.labels("scale").inc()
            return False

    # -- one look ---------------------------------------------------------------------------
    async def look(self) -> Decision | None:
        try:
            members = await asyncio.to_thread(self.members)
        except (OSError, ValueError, KeyError) as exc:
            if self.reachable:        # said once, not every look
                logger.warning("planner: reading the orchestrator's members failed (%s); "
                               "trying every %g s", exc, self.config.interval)
            self.reachable = False
            self.metrics.errors.labels("members").inc()
            return None
        if not self.reachable:
            logger.info("planner: %s answers again", self.orchestrator)
        self.reachable = True
        if self._waiting(len(members)):
            return None
        samples = await asyncio.gather(*(asyncio.to_thread(self.scrape, m["url"])
                                         for m in members))
        now = time.monotonic()
        self.window.keep(m["url"] for m in members)
        for m, sample in zip(members, samples):
            if sample is not None:
                self.window.add(m["url"], now, sample)
        decision = decide(*self._pools(members), min_samples=self.config.min_samples,
                          headroom=self.config.headroom, min_ctx=self.config.min_ctx,
                          min_gen=self.config.min_gen,
                          cooling=now - self.last_move < self.config.cooldown,
                          scale=self.scaling)
        await self._act(decision, len(members))
        return decision

    def _waiting(self, count: int) -> bool:
        """An add or retire not yet seen in the members: no other change meanwhile (a worker
        starts in seconds; counting it missing would ask for another). Once seen, the
        cooldown starts, and a fresh window."""
        if self.pending is None:
            return False
        target, deadline = self.pending
        now = time.monotonic()
        if count != target and now < deadline:
            return True
        if count != target:
            logger.warning("planner: %d members after %g s, not the %d asked for; going on",
                           count, CHANGE_TIMEOUT, target)
        self.pending = None
        self.last_move = now
        self.window.restart()
        return False

    def _pools(self, members: list[dict]) -> tuple[PoolView, PoolView]:
        views = []
        for name, histogram, slo in (("ctx", "ttft", self.config.ttft_p90_ms),
                                     ("gen", "itl", self.config.itl_p90_ms)):
            urls = [m["url"] for m in members if m["role"] == REGISTERED_ROLE[name]]
            loads = {u: s.load for u in urls if (s := self.window.latest(u)) is not None}
            p90, samples = self.window.p90(urls, histogram)
            self.metrics.workers.labels(name).set(len(urls))
            if p90 is not None:
                self.metrics.p90.labels(histogram).set(p90 / 1000)
            views.append(PoolView(name, loads, p90, samples, slo))
        return views[0], views[1]

    async def _act(self, decision: Decision, count: int) -> None:
        if decision.action == "hold":
            self.metrics.holds.labels(decision.reason).inc()
            if decision.reason != self.last_reason:
                logger.info("planner: %s", decision.describe())
            self.last_reason = decision.reason
            return
        logger.info("planner: %s", decision.describe())
        self.last_reason = None
        if decision.action == "move":
            done = await asyncio.to_thread(self.move, decision.url, decision.dst)
            if done:
                self.metrics.moves.labels(decision.src, decision.dst).inc()
        else:
            pool = decision.dst if decision.action == "add" else decision.src
            done = self.ask({"add": pool} if decision.action == "add"
                            else {"retire": decision.url})
            if done:
                self.metrics.scaled.labels(decision.action, pool).inc()
                change = 1 if decision.action == "add" else -1
                self.pending = (count + change, time.monotonic() + CHANGE_TIMEOUT)
                return
        if done:
            self.last_move = time.monotonic()
            self.window.restart()

    async def run(self, should_stop=None) -> None:
        while should_stop is None or not should_stop():
            await self.look()
            await asyncio.sleep(self.config.interval)


class PlannerServer:
    """/metrics and /health of the planner (it binds loopback unless told otherwise)."""

    def __init__(self, planner: Planner):
        self.planner = planner
        self.router = Router({"/metrics": Route("GET", self.prometheus, NO_BODY),
                              "/health": Route("GET", self.health, NO_BODY)}, status_error_body)
        self.http = HTTPServer(self.router.dispatch, NO_BODY, "planner",
                               error_body=status_error_body, check_head=self.check_head)

    def check_head(self, request: Request) -> Admission | Response:
        found = self.router.find(request)
        return found if isinstance(found, Response) else Admission(Standing.CLIENT,
                                                                   found.max_body)

    async def prometheus(self, request: Request) -> Response:
        return Response(self.planner.metrics.registry.render(),
                        content_type=Registry.CONTENT_TYPE)

    async def health(self, request: Request) -> Response:
        return Response(orjson.dumps({"status": "ok"}))


async def run_planner(config: PlannerConfig, should_stop=None) -> None:
    secret = envs.internal_secret()
    if not secret:
        raise ValueError("the planner needs the cluster's internal secret "
                         "(SPLITSERVE_INTERNAL_SECRET)")
    planner = Planner(config, secret, envs.planner_scale_fd())
    if config.max_workers is not None and planner.scale_fd is None:
        logger.warning("planner: --max-workers is for a planner that may start workers "
                       "(up --planner); this one only moves them")
    server = PlannerServer(planner)
    await server.http.start(config.host, config.port, 128)
    logger.info("planner: %s, SLO ttft p90 %s ms, itl p90 %s ms; metrics on http://%s:%d",
                planner.orchestrator, config.ttft_p90_ms, config.itl_p90_ms, config.host,
                server.http.port)
    task = asyncio.create_task(planner.run())
    try:
        await wait_for_stop_signal(should_stop)
    finally:
        task.cancel()
        await server.http.close()
