"""The orchestrator: the cluster's OpenAI front door (`splitserve orchestrator -c cluster.yaml`)."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import orjson
from aiohttp import web

from splitserve.errors import InvalidRequestError
from splitserve.gc_policy import ServingGC
from splitserve.httpd.limits import LISTEN_BACKLOG
from splitserve.metrics import Counter, Gauge, Histogram, Registry
from splitserve.orchestrator import migrate, relay, stream, upstream
from splitserve.orchestrator.cluster import ClusterConfig, Server
from splitserve.orchestrator.pools import ROLE, Pool, Tries
from splitserve.signals import wait_for_stop_signal
from splitserve.trust import INTERNAL_HEADER, Gate

logger = logging.getLogger(__name__)

NO_SECRET = ("the orchestrator needs the cluster's internal secret (the one its workers have) "
             "to call its workers: pass --internal-secret, set internal_secret in the cluster "
             "YAML, or set SPLITSERVE_INTERNAL_SECRET")


class OrchestratorMetrics:
    def __init__(self):
        self.registry = r = Registry()
        p = "splitserve_orchestrator_"
        self.requests = r.register(Counter(p + "requests_total", "Requests by endpoint, route and status",
                                           ("endpoint", "route", "status")))
        self.preprocessing = r.register(Histogram(p + "preprocessing_seconds",
                                                  "Client request arrival to CTX request sent"))
        self.ctx = r.register(Histogram(p + "ctx_seconds", "CTX round trip: queue, prefill, first token"))
        self.relay = r.register(Histogram(p + "relay_seconds", "CTX answer to GEN request sent"))
        self.gen_first_byte = r.register(Histogram(p + "gen_first_byte_seconds",
                                                   "GEN request sent to its first event (a whole answer: all of it)"))
        self.e2e = r.register(Histogram(p + "e2e_seconds", "Client arrival to the last byte"))
        self.retries = r.register(Counter(p + "retries_total",
                                          "Tries that failed before any byte reached the client "
                                          "and were tried again, by pool and reason",
                                          ("pool", "reason")))
        self.in_flight = r.register(Gauge(p + "requests_in_flight",
                                          "Client requests being served (past max_in_flight: 503)"))
        self.migrations = r.register(Counter(p + "migrations_total",
                                             "Broken streams continued on another generation "
                                             "worker, by outcome", ("outcome",)))
        self.relay_modes = r.register(Counter(p + "token_relay_total",
                                              "Requests relayed to GEN, by token relay mode", ("mode",)))


class Orchestrator:
    def __init__(self, config: ClusterConfig):
        if not config.internal_secret:
            raise ValueError(NO_SECRET)
        self.config = config
        self.gate = Gate(config.api_key, None)
        self.ctx = Pool("ctx", config.context_servers.urls, config.context_servers.router)
        self.gen = Pool("gen", config.generation_servers.urls, config.generation_servers.router)
        self.metrics = OrchestratorMetrics()
        self.app = web.Application(client_max_size=256 << 20, middlewares=[self.check_key])
        self.app.add_routes([
            web.post("/v1/completions", self.generate), web.post("/v1/chat/completions", self.generate),
            web.get("/v1/models", self.models), web.get("/health", self.health),
            web.get("/metrics", self.prometheus)])
        self.session: aiohttp.ClientSession | None = None
        self.gc = ServingGC()
        self.in_flight = 0

    # -- the request path -----------------------------------------------------------------
    @web.middleware
    async def check_key(self, request: web.Request, handler) -> web.StreamResponse:
        """401 on a public route without the API key (when one is set)."""
        refusal = self.gate.key_refusal(request.path, request.headers.get)
        if refusal is not None:
            routed = request.match_info.http_exception is None   # (a bounded label set)
            self.metrics.requests.labels(request.path if routed else "other", "refused",
                                         refusal.status).inc()
            return web.Response(status=refusal.status, body=refusal.body,
                                content_type="application/json", headers=refusal.headers)
        return await handler(request)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if self.in_flight >= self.config.max_in_flight:
            self.metrics.requests.labels(request.path, "shed", 503).inc()
            return relay.json_error(503, f"the server is at capacity ({self.in_flight} requests "
                                         f"in flight); retry later", retry_after=1)
        t0, route, status = time.time(), "disagg", 500
        self.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            body = relay.parse_body(await request.read())
            if relay.needs_aggregated(body):
                route = "aggregated"
            resp = await self._serve(request, body, route == "aggregated", t0)
            route, status = resp.get("route", route), resp.status
            return resp
        except InvalidRequestError as exc:
            status = 400
            return relay.json_error(400, exc.message, "invalid_request_error", exc.param)
        except relay.UpstreamError as exc:
            status = exc.status
            return relay.json_error(exc.status, str(exc), retry_after=exc.retry_after)
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(request.path, route, status).inc()
            self.metrics.e2e.observe(time.time() - t0)

    async def _serve(self, request, body: dict, aggregated: bool, t0: float) -> web.StreamResponse:
        """The one retry loop: CTX prefill (unless aggregated), then GEN, each tried again on
        a failure that reached nothing of the client. A failed GEN try prefills again: the
        CTX lease may be gone (the dead GEN pulled and acked it, or it expired)."""
        key, mode = relay.prefix_key(body), None
        if aggregated:
            ctx_data, gen_data = None, orjson.dumps(body)
        else:
            mode = relay.relay_mode(body, self.config.token_relay)
            ctx_data, gen_data = orjson.dumps(relay.context_body(body, mode)), None
            self.metrics.preprocessing.observe(time.time() - t0)
        tries = Tries(self.config.max_retries, self.metrics.retries)
        migratable = not aggregated and body.get("stream") is True and self.config.migrate_streams
        while True:
            pool = self.gen if gen_data is not None else self.ctx
            server = tries.pick(pool, key)
            try:
                if gen_data is not None:
                    tap, carry_on = (self._migration(request.path, body, key,
                                                     [*tries.failed["gen"], server])
                                     if migratable else (None, None))
                    return await self._generate_on(server, request, gen_data, tap, carry_on)
                status, answer = await self._prefill(server, request.path, ctx_data)
                params = answer.get("disaggregated_params") if status == 200 else None
                if not params or not params.get("kv_handle"):
                    return _ctx_answer(body, status, answer)
                ctx_done = time.time()
                gen_data = orjson.dumps(relay.generation_body(body, params, migratable))
                self.metrics.relay_modes.labels(mode).inc()
                self.metrics.relay.observe(time.time() - ctx_done)
            except upstream.Retry as exc:
                tries.failed_on(pool, server, exc)
                if not aggregated:
                    gen_data = None
            except upstream.TimedOut:
                raise relay.UpstreamError(
                    f"the {ROLE[pool.name]} worker did not answer within "
                    f"{self.config.first_byte_timeout:g} s", 504, None) from None

    def _migration(self, path: str, body: dict, key: bytes, avoid: list):
        """(tap, carry_on) for stream.forward: a stream whose GEN breaks goes on elsewhere."""
        tap = migrate.StreamTap()

        async def carry_on(resp, problem: str) -> str | None:
            return await migrate.carry_on(self, path, resp, tap, body, key, avoid, problem)
        return tap, carry_on

    async def _prefill(self, server: Server, path: str, data: bytes) -> tuple[int, dict]:
        server.in_flight += 1
        t = time.time()
        try:
            return await upstream.post_json(self.session, server.url + path, data,
                                            self.config.first_byte_timeout)
        finally:
            server.in_flight -= 1
            self.metrics.ctx.observe(time.time() - t)

    async def _generate_on(self, server: Server, request, data: bytes, tap=None,
                           carry_on=None) -> web.StreamResponse:
        server.in_flight += 1
        try:
            t = time.time()
            held = await upstream.open_generation(self.session, server.url + request.path, data,
                                                  self.config.first_byte_timeout)
            self.metrics.gen_first_byte.observe(time.time() - t)
            try:
                resp = await stream.forward(request, held, self.config.idle_timeout, tap, carry_on)
            except BaseException:
                held.response.close()    # GEN sees the connection go and aborts the request
                raise
            held.response.release()
            return resp
        finally:
            server.in_flight -= 1

    def mark_down(self, url: str) -> None:
        """A worker is known to be gone (its process exited): route around it at once."""
        for pool in (self.ctx, self.gen):
            pool.mark_down(url)

    # -- small endpoints and health -------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        for server in self.gen.servers:
            if server.healthy:
                try:
                    async with self.session.get(server.url + "/v1/models", timeout=_PROBE) as r:
                        if r.status != 200:   # (a worker's refusal is not the client's answer)
                            continue
                        return web.Response(body=await r.read(), content_type="application/json")
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    continue
        return relay.json_error(503, "no generation worker is available; retry later",
                                retry_after=self.config.health_check_interval)

    async def health(self, request: web.Request) -> web.Response:
        """200 while every pool has a healthy server (status "degraded" if some are down)."""
        pools = (self.ctx, self.gen)
        up = {p.name: [s.url for s in p.servers if s.healthy] for p in pools}
        ok = all(up.values())
        whole = ok and all(len(up[p.name]) == len(p.servers) for p in pools)
        return web.json_response({"status": "ok" if whole else "degraded", "healthy": up},
                                 status=200 if ok else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.registry.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _health_loop(self) -> None:
        checks = [(pool, server) for pool in (self.ctx, self.gen) for server in pool.servers]
        while True:
            # Concurrently: a worker that hangs must not delay the others' verdicts.
            await asyncio.gather(*(self._check_health(p, s) for p, s in checks))
            await asyncio.sleep(self.config.health_check_interval)

    async def _check_health(self, pool: Pool, server: Server) -> None:
        try:
            async with self.session.get(server.url + "/health", timeout=_PROBE) as r:
                healthy = r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            healthy = False
        if healthy != server.healthy:
            logger.info("orch: %s server %s is %s", pool.name, server.url,
                        "up" if healthy else "down")
        server.healthy = healthy

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> web.AppRunner:
        # No total or read timeout here: upstream.py bounds the wait for the first byte,
        # stream.py the gaps in a stream, however long the stream runs.
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout),
            connector=aiohttp.TCPConnector(limit=0),
            # Every request to a worker: CTX, GEN, migrations, health checks, /v1/models.
            headers={INTERNAL_HEADER: self.config.internal_secret})
        self._health_task = asyncio.create_task(self._health_loop())
        self.gc.start()
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await runner.setup()
        # backlog: connections a burst may open before the loop accepts them
        await web.TCPSite(runner, self.config.host, self.config.port, backlog=LISTEN_BACKLOG).start()
        logger.info("orch: serving on http://%s:%d (ctx: %s; gen: %s)", self.config.host,
                    self.config.port, ", ".join(s.url for s in self.ctx.servers),
                    ", ".join(s.url for s in self.gen.servers))
        return runner

    async def stop(self, runner: web.AppRunner) -> None:
        self._health_task.cancel()
        await runner.cleanup()
        self.gc.stop()
        await self.session.close()


_PROBE = aiohttp.ClientTimeout(total=2.0)   # health checks and /v1/models


def _ctx_answer(body: dict, status: int, answer: dict) -> web.Response:
    """CTX finished the request (EOS, stop, max_tokens 1) or refused it: its answer stands,
    as SSE if the client streams."""
    answer.pop("disaggregated_params", None)
    if status == 200 and body.get("stream"):
        include = bool((body.get("stream_options") or {}).get("include_usage"))
        resp = web.Response(body=relay.as_stream(answer, include), content_type=relay.SSE)
    else:
        resp = web.Response(status=status, body=orjson.dumps(answer),
                            content_type="application/json")
    resp["route"] = "ctx_only"
    return resp


def _report_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("orch: %s stopped", task.get_coro().__qualname__, exc_info=task.exception())


async def run_orchestrator(config: ClusterConfig, should_stop=None, banner: str = "",
                           companion=None) -> None:
    """Serve until Ctrl-C / SIGTERM (or should_stop() turns true). companion: a coroutine
    function of the Orchestrator run alongside it (`splitserve up` watches its workers),
    cancelled first on the way out."""
    orch = Orchestrator(config)
    runner = await orch.start()
    task = None
    if companion is not None:
        task = asyncio.create_task(companion(orch))
        task.add_done_callback(_report_failure)
    if banner:
        print(banner, flush=True)
    try:
        await wait_for_stop_signal(should_stop)
    finally:
        if task is not None:
            task.cancel()
        await orch.stop(runner)
