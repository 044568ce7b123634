"""The cluster's workers as the orchestrator sees them: a pool per role (its servers, their
health, a router), one request's tries on the pools, and the one retry loop that serves a
request: CTX prefill (unless aggregated), then GEN, each tried again elsewhere on a failure
that reached nothing of the client. Every request to a worker goes through here, with that
worker's own token (trust.py; cluster.Credentials), never a session-wide header."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import orjson

from splitserve.orchestrator import migrate, relay, stream, upstream
from splitserve.orchestrator.cluster import ClusterConfig, Credentials, Server
from splitserve.orchestrator.probes import PROBE, PROBE_MAX_BYTES, Probes
from splitserve.orchestrator.relay import UpstreamError
from splitserve.orchestrator.routers import RequestInfo, make_router, route
from splitserve.orchestrator.upstream import Retry
from splitserve.protocol.roles import REGISTERED_ROLE
from splitserve.trust import INTERNAL_HEADER, Keys

logger = logging.getLogger(__name__)


class Pool:
    """A role's servers: the YAML's (static, permanent) and the registered ones
    (orchestrator/registry.py), which come and go with sync(). on_down(pool, server): a
    server was marked down (Probes.recheck checks it at once)."""

    def __init__(self, name: str, urls, router: str, on_down=lambda pool, server: None):
        self.name, self.on_down = name, on_down
        self.role = REGISTERED_ROLE[name]   # what its workers register as (and are called)
        self.servers = [Server(u.rstrip("/")) for u in urls]
        self.router = make_router(router)

    def sync(self, urls) -> list[Server]:
        """The registered members are `urls` now: new ones join (returned: routed to once a
        health check verifies them), the others leave. A request in flight on a server that
        left finishes there: it holds the Server, the pool no longer offers it."""
        urls = {u.rstrip("/") for u in urls}
        kept = [s for s in self.servers if s.static or s.url in urls]
        for s in self.servers:
            if not s.static and s.url not in urls:
                logger.info("orch: %s server %s left the pool", self.name, s.url)
        added = sorted(urls - {s.url for s in kept})
        for url in added:
            logger.info("orch: %s server %s joined the pool", self.name, url)
        joined = [Server(u, static=False) for u in added]
        if added or len(kept) != len(self.servers):
            self.servers = kept + joined
        return joined

    def pick(self, info: RequestInfo, avoid=()) -> Server | None:
        """A healthy server, one not in `avoid` if there is one."""
        healthy = [s for s in self.servers if s.healthy]
        fresh = [s for s in healthy if s not in avoid] if avoid else healthy
        candidates = fresh or healthy
        return route(self.router, candidates, info) if candidates else None

    def mark_down(self, url: str) -> None:
        """Not routed to, its credentials forgotten, until a health check verifies it again
        (on_down: at once; the check logs the verdict)."""
        for s in self.servers:
            if s.url == url and s.healthy:
                s.healthy, s.creds = False, None
                self.on_down(self, s)


class Tries:
    """One request's tries: per pool, the servers that failed it (tried again only when no
    other is healthy) and how many more failures it survives. rid: its X-Request-Id."""

    def __init__(self, max_retries: int, retries_metric, probes: Probes, rid: str):
        self.max_retries, self.metric, self.probes = max_retries, retries_metric, probes
        self.rid = rid
        self.failed: dict[str, list[Server]] = {"ctx": [], "gen": []}

    async def pick(self, pool: Pool, info: RequestInfo) -> Server:
        """A server to try; with none healthy, after the rechecks under way (a worker that
        just restarted, or just joined, is verified in milliseconds)."""
        server = pool.pick(info, self.failed[pool.name])
        if server is None and await self.probes.settle(pool):
            server = pool.pick(info, self.failed[pool.name])
        if server is None:
            raise UpstreamError(f"no {pool.role} worker is available; retry later")
        return server

    def failed_on(self, pool: Pool, server: Server, exc: Retry) -> None:
        """Note the failure; UpstreamError once the pool has failed too often."""
        failed = self.failed[pool.name]
        failed.append(server)
        if exc.down:
            pool.mark_down(server.url)
        if len(failed) > self.max_retries:
            logger.warning("orch: request %s: %s server %s failed (%s); giving up after %d "
                           "tries", self.rid, pool.name, server.url, exc, len(failed))
            raise UpstreamError(f"no {pool.role} worker could serve this request "
                                f"({len(failed)} tries failed); retry later")
        logger.warning("orch: request %s: %s server %s failed (%s); trying again", self.rid,
                       pool.name, server.url, exc)
        self.metric.labels(pool.name, exc.reason).inc()


def _handoff(body: dict, status: int, answer: dict) -> dict | None:
    """A CTX answer's disaggregated_params to hand to a GEN; None: the CTX ended the request
    (or refused it) and its answer goes to the client. Retry: an answer shaped so that
    neither can be done (only what is read here is checked; a GEN checks the handoff)."""
    params = answer.get("disaggregated_params") if status == 200 else None
    if params is not None and not isinstance(params, dict):
        raise Retry("malformed", "answered disaggregated_params that are not an object")
    if params and params.get("kv_handle"):
        if not isinstance(params["kv_handle"], dict):
            raise Retry("malformed", "answered a kv_handle that is not an object")
        return params
    choices = answer.get("choices", [])
    if status == 200 and body.get("stream") and not (isinstance(choices, list) and all(
            isinstance(c, dict) and isinstance(c.get("index"), int)
            and isinstance(c.get("message") or {}, dict) for c in choices)):
        raise Retry("malformed", "answered choices that are not objects with an index")
    return None


class Pools:
    """Both pools, the HTTP client session to their workers, and their health checks."""

    def __init__(self, config: ClusterConfig, metrics):
        self.config, self.metrics = config, metrics
        self.keys = Keys(config.internal_secret)
        self.probes = Probes(self)
        self.ctx = Pool("ctx", config.context_servers.urls, config.context_servers.router,
                        self.probes.recheck)
        self.gen = Pool("gen", config.generation_servers.urls,
                        config.generation_servers.router, self.probes.recheck)
        self.session: aiohttp.ClientSession | None = None

    # -- one request ----------------------------------------------------------------------
    async def serve(self, request, body: dict, aggregated: bool, t0: float, info: RequestInfo):
        """(the client's response, its route label). request: the client's httpd Request,
        which a GEN stream is written to; info: what the routers read (decide.py). A failed
        GEN try prefills again: the CTX lease may be gone (the dead GEN pulled and acked it,
        or it expired)."""
        mode = None
        if aggregated:
            ctx_data, gen_data = None, orjson.dumps(body)
        else:
            mode = relay.relay_mode(body, self.config.token_relay)
            ctx_data, gen_data = orjson.dumps(relay.context_body(body, mode)), None
            self.metrics.preprocessing.observe(time.time() - t0)
        tries = Tries(self.config.max_retries, self.metrics.retries, self.probes,
                      request.id)
        migratable = not aggregated and body.get("stream") is True and self.config.migrate_streams
        prompt = info.num_tokens or 0    # counted only where a decision reads it (decide.py)
        while True:
            pool = self.gen if gen_data is not None else self.ctx
            server = await tries.pick(pool, info)
            try:
                if gen_data is not None:
                    tap, carry_on = (self._migration(request, body, info,
                                                     [*tries.failed["gen"], server])
                                     if migratable else (None, None))
                    return await self._generate_on(server, request, gen_data, tap, carry_on,
                                                   prompt if aggregated else None), None
                status, answer = await self._prefill(server, request, ctx_data, prompt)
                params = _handoff(body, status, answer)
                if params is None:
                    return stream.ctx_answer(body, status, answer), "ctx_only"
                ctx_done = time.time()
                gen_data = orjson.dumps(relay.generation_body(body, params, migratable))
                self.metrics.relay_modes.labels(mode).inc()
                self.metrics.relay.observe(time.time() - ctx_done)
            except upstream.Retry as exc:
                tries.failed_on(pool, server, exc)
                if not aggregated:
                    gen_data = None
            except upstream.TimedOut:
                raise UpstreamError(
                    f"the {pool.role} worker did not answer within "
                    f"{self.config.first_byte_timeout:g} s", 504, None) from None

    async def forward(self, request) -> tuple[int, bytes]:
        """(status, body) of a request a worker answers whole and that changes nothing
        (/tokenize, /detokenize): the client's body as it came to a generation worker (it
        checks it: its 400 is the answer), tried again elsewhere as a generation is."""
        tries = Tries(self.config.max_retries, self.metrics.retries, self.probes,
                      request.id)
        while True:
            server = await tries.pick(self.gen, RequestInfo())
            try:
                status, answer = await upstream.post_json(
                    self.session, server.url + request.path, upstream.creds_of(server),
                    request.body, self.config.first_byte_timeout, request.id)
                return status, orjson.dumps(answer)
            except upstream.Retry as exc:
                tries.failed_on(self.gen, server, exc)
            except upstream.TimedOut:
                raise UpstreamError(f"the generation worker did not answer within "
                                    f"{self.config.first_byte_timeout:g} s", 504, None) from None

    def _migration(self, request, body: dict, info: RequestInfo, avoid: list):
        """(tap, carry_on) for stream.forward: a stream whose GEN breaks goes on elsewhere."""
        tap = migrate.StreamTap()

        async def carry_on(out, problem: str) -> str | None:
            return await migrate.carry_on(self, request, out, tap, body, info, avoid, problem)
        return tap, carry_on

    async def _prefill(self, server: Server, request, data: bytes,
                       prompt: int) -> tuple[int, dict]:
        server.in_flight += 1
        server.prefill_sent += prompt
        t = time.time()
        try:
            return await upstream.post_json(self.session, server.url + request.path,
                                            upstream.creds_of(server), data,
                                            self.config.first_byte_timeout, request.id)
        finally:
            server.in_flight -= 1
            server.prefill_sent -= prompt
            self.metrics.ctx.observe(time.time() - t)

    async def _generate_on(self, server: Server, request, data: bytes, tap=None,
                           carry_on=None, prompt: int | None = None):
        """prompt: a whole request's prompt tokens (None: its KV is pulled), counted as
        the GEN's prefill work until its first event (queue_prefill.py reads it)."""
        server.in_flight += 1
        try:
            t = time.time()
            held = await self._open_generation(server, request, data, prompt)
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

    async def _open_generation(self, server: Server, request, data: bytes, prompt: int | None):
        local = prompt is not None
        server.local_prefills += local
        server.prefill_sent += prompt or 0
        try:
            return await upstream.open_generation(self.session, server.url + request.path,
                                                  upstream.creds_of(server), data,
                                                  self.config.first_byte_timeout, request.id)
        finally:
            server.local_prefills -= local
            server.prefill_sent -= prompt or 0

    # -- health and models ----------------------------------------------------------------
    def mark_down(self, url: str) -> None:
        """A worker is known to be gone (its process exited): route around it at once."""
        for pool in (self.ctx, self.gen):
            pool.mark_down(url)

    def sync(self, members: list[dict]) -> None:
        """The registry's members (orchestrator/registry.py) join or leave the pools; those
        that join are checked at once."""
        for pool in (self.ctx, self.gen):
            for server in pool.sync(m["url"] for m in members if m["role"] == pool.role):
                self.probes.recheck(pool, server)

    def credentials(self, instance: str) -> Credentials:
        """What requests to (and answers from) a server proven to be `instance` carry."""
        return Credentials(instance, self.keys.token(instance), self.keys.proof(instance))

    def health(self) -> tuple[dict, int]:
        """200 while every pool has a healthy server (status "degraded" if some are down)."""
        pools = (self.ctx, self.gen)
        up = {p.name: [s.url for s in p.servers if s.healthy] for p in pools}
        ok = all(up.values())
        whole = ok and all(len(up[p.name]) == len(p.servers) for p in pools)
        return {"status": "ok" if whole else "degraded", "healthy": up}, 200 if ok else 503

    async def models(self) -> bytes | None:
        """The first healthy generation worker's /v1/models body; None: none answered."""
        for server in self.gen.servers:
            creds = server.creds
            if server.healthy and creds is not None:
                try:
                    async with self.session.get(server.url + "/v1/models", timeout=PROBE,
                                                headers={INTERNAL_HEADER: creds.token},
                                                allow_redirects=False) as r:
                        # (a worker's refusal is not the client's answer, nor an unproven one)
                        if r.status != 200 or not upstream.is_proven(r, creds):
                            continue
                        body = await upstream.read_at_most(r, PROBE_MAX_BYTES)
                        if body is not None:
                            return body
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    continue
        return None

    async def start(self, membership=None) -> None:
        """membership: where the registered workers are read (orchestrator/registry.py)."""
        # No total or read timeout here: upstream.py bounds the wait for the first byte,
        # stream.py the gaps in a stream, however long the stream runs.
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout),
            connector=aiohttp.TCPConnector(limit=0))
        self.probes.start(membership)

    async def stop(self) -> None:
        self.probes.stop()
        await self.session.close()
