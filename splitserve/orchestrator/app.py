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
from splitserve.orchestrator import relay
from splitserve.orchestrator.cluster import ClusterConfig, Server
from splitserve.orchestrator.routers import make_router
from splitserve.server.config import LISTEN_BACKLOG
from splitserve.server.metrics import Counter, Histogram, Registry
from splitserve.signals import wait_for_stop_signal

logger = logging.getLogger(__name__)


class Pool:
    def __init__(self, name: str, urls, router: str):
        self.name = name
        self.servers = [Server(u.rstrip("/")) for u in urls]
        self.router = make_router(router)

    def pick(self, key: bytes, exclude: set) -> Server | None:
        healthy = [s for s in self.servers if s.healthy and s not in exclude]
        return self.router.pick(healthy, key) if healthy else None


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
                                                   "GEN request sent to its first response byte"))
        self.e2e = r.register(Histogram(p + "e2e_seconds", "Client arrival to the last byte"))
        self.retries = r.register(Counter(p + "retries_total", "Requests retried on another server",
                                          ("pool",)))
        self.relay_modes = r.register(Counter(p + "token_relay_total",
                                              "Requests relayed to GEN, by token relay mode", ("mode",)))


class Orchestrator:
    def __init__(self, config: ClusterConfig):
        self.config = config
        self.ctx = Pool("ctx", config.context_servers.urls, config.context_servers.router)
        self.gen = Pool("gen", config.generation_servers.urls, config.generation_servers.router)
        self.metrics = OrchestratorMetrics()
        self.app = web.Application(client_max_size=256 << 20)
        self.app.add_routes([
            web.post("/v1/completions", self.generate), web.post("/v1/chat/completions", self.generate),
            web.get("/v1/models", self.models), web.get("/health", self.health),
            web.get("/metrics", self.prometheus)])
        self.session: aiohttp.ClientSession | None = None
        self.gc = ServingGC()

    # -- the request path -----------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        t0, route, status = time.time(), "disagg", 500
        try:
            body = relay.parse_body(await request.read())
            key = relay.prefix_key(body)
            if relay.needs_aggregated(body):
                route = "aggregated"
                resp = await self._to_gen(request, body, key)
            else:
                resp = await self._split(request, body, key, t0)
                route = resp.get("route", route)
            status = resp.status
            return resp
        except InvalidRequestError as exc:
            status = 400
            return relay.json_error(400, exc.message, "invalid_request_error", exc.param)
        except relay.UpstreamError as exc:
            status = 503
            return relay.json_error(503, str(exc))
        finally:
            self.metrics.requests.labels(request.path, route, status).inc()
            self.metrics.e2e.observe(time.time() - t0)

    async def _split(self, request, body: dict, key: bytes, t0: float) -> web.StreamResponse:
        mode = relay.relay_mode(body, self.config.token_relay)
        ctx_body = orjson.dumps(relay.context_body(body, mode))
        self.metrics.preprocessing.observe(time.time() - t0)
        t1 = time.time()
        status, answer = await self._post_json(self.ctx, request.path, ctx_body, key)
        self.metrics.ctx.observe(time.time() - t1)
        params = answer.get("disaggregated_params") if status == 200 else None
        if not params or not params.get("kv_handle"):
            # CTX finished the request (EOS, stop, max_tokens 1) or refused it: its answer stands.
            if status == 200 and body.get("stream"):
                include = bool((body.get("stream_options") or {}).get("include_usage"))
                answer.pop("disaggregated_params", None)
                resp = web.Response(body=relay.as_stream(answer, include), content_type=relay.SSE)
            else:
                answer.pop("disaggregated_params", None)
                resp = web.Response(status=status, body=orjson.dumps(answer),
                                    content_type="application/json")
            resp["route"] = "ctx_only"
            return resp
        self.metrics.relay_modes.labels(mode).inc()
        return await self._to_gen(request, relay.generation_body(body, params), key, time.time())

    async def _post_json(self, pool: Pool, path: str, data: bytes, key: bytes) -> tuple[int, dict]:
        tried: set = set()
        while (server := pool.pick(key, tried)) is not None:
            tried.add(server)
            server.in_flight += 1
            try:
                async with self.session.post(server.url + path, data=data, headers=_headers()) as r:
                    return r.status, orjson.loads(await r.read())
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                self._down(pool, server, exc)
            finally:
                server.in_flight -= 1
        raise relay.UpstreamError(f"no {pool.name} server could take the request")

    async def _to_gen(self, request, body: dict, key: bytes,
                      ctx_done: float | None = None) -> web.StreamResponse:
        """Send to a generation server; retry on another while no byte reached the client."""
        data, tried = orjson.dumps(body), set()
        if ctx_done is not None:
            self.metrics.relay.observe(time.time() - ctx_done)
        while (server := self.gen.pick(key, tried)) is not None:
            tried.add(server)
            server.in_flight += 1
            try:
                t = time.time()
                async with self.session.post(server.url + request.path, data=data,
                                             headers=_headers()) as upstream:
                    self.metrics.gen_first_byte.observe(time.time() - t)
                    return await relay.pass_through(request, upstream)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                self._down(self.gen, server, exc)
            finally:
                server.in_flight -= 1
        raise relay.UpstreamError("no generation server could take the request")

    def _down(self, pool: Pool, server: Server, exc: Exception) -> None:
        logger.warning("orch: %s server %s failed (%s); trying another", pool.name, server.url, exc)
        server.healthy = False
        self.metrics.retries.labels(pool.name).inc()

    # -- small endpoints and health -------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        for server in self.gen.servers:
            if server.healthy:
                try:
                    async with self.session.get(server.url + "/v1/models") as r:
                        return web.Response(status=r.status, body=await r.read(),
                                            content_type="application/json")
                except aiohttp.ClientError:
                    continue
        return relay.json_error(503, "no generation server is up")

    async def health(self, request: web.Request) -> web.Response:
        up = {p.name: [s.url for s in p.servers if s.healthy] for p in (self.ctx, self.gen)}
        ok = all(up.values())
        return web.json_response({"status": "ok" if ok else "degraded", "healthy": up},
                                 status=200 if ok else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.registry.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _health_loop(self) -> None:
        timeout = aiohttp.ClientTimeout(total=2.0)
        while True:
            for pool in (self.ctx, self.gen):
                for server in pool.servers:
                    try:
                        async with self.session.get(server.url + "/health", timeout=timeout) as r:
                            healthy = r.status == 200
                    except (aiohttp.ClientError, asyncio.TimeoutError):
                        healthy = False
                    if healthy != server.healthy:
                        logger.info("orch: %s server %s is %s", pool.name, server.url,
                                    "up" if healthy else "down")
                    server.healthy = healthy
            await asyncio.sleep(self.config.health_check_interval)

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> web.AppRunner:
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout, sock_connect=5.0),
            connector=aiohttp.TCPConnector(limit=0))
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


def _headers() -> dict:
    # The receiver measures its preprocessing from the moment we wrote the request.
    return {"Content-Type": "application/json", "X-Sent-At": repr(time.time())}


async def run_orchestrator(config: ClusterConfig, should_stop=None, banner: str = "") -> None:
    """Serve until Ctrl-C / SIGTERM (or should_stop() turns true)."""
    orch = Orchestrator(config)
    runner = await orch.start()
    if banner:
        print(banner, flush=True)
    try:
        await wait_for_stop_signal(should_stop)
    finally:
        await orch.stop(runner)
