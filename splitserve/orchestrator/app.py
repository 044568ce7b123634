"""The orchestrator: the cluster's OpenAI front door (`splitserve orchestrator -c cluster.yaml`).

HTTP handlers only: routing, the API key (both checked on a request's head, before its body
is read), shedding past max_in_flight, and errors as OpenAI bodies. Serving a request on the
workers is pools.py's; the bodies sent them are relay.py's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import orjson

from splitserve.errors import InvalidRequestError
from splitserve.gc_policy import ServingGC
from splitserve.httpd import ChunkedStream, HTTPLimits, HTTPServer, Request, Response
from splitserve.httpd.connections import Standing
from splitserve.httpd.limits import FD_HEADROOM, LISTEN_BACKLOG, raise_fd_limit
from splitserve.httpd.router import ANY, NO_BODY, Route, Router
from splitserve.httpd.server import Admission
from splitserve.orchestrator import relay, resume, split
from splitserve.orchestrator.cluster import ClusterConfig
from splitserve.orchestrator.decide import Decider
from splitserve.orchestrator.etcd_membership import EtcdMembership
from splitserve.orchestrator.metrics import OrchestratorMetrics
from splitserve.orchestrator.pools import Pools
from splitserve.orchestrator.registry import (NOT_INTERNAL, PATHS, LocalMembership, Registry,
                                              RemoteMembership)
from splitserve.protocol.cache_salt import CacheIsolation, derivation_key
from splitserve.protocol.membership import parse_target
from splitserve.protocol.openai import error_body, status_error_body
from splitserve.protocol.openai_fields import UnknownFields
from splitserve.request_log import log_finished
from splitserve.signals import wait_for_stop_signal
from splitserve.trust import Gate
from splitserve.version import __version__

logger = logging.getLogger(__name__)

REGISTRATION_MAX_BODY = 64 << 10    # a registration body is a role, a url and a ttl
NO_SECRET = ("the orchestrator needs the cluster's internal secret (the one its workers have) "
             "to call its workers: pass --internal-secret, set internal_secret in the cluster "
             "YAML, or set SPLITSERVE_INTERNAL_SECRET")


class Orchestrator:
    """control_url: one of a fleet (fleet.py): the port is shared (SO_REUSEPORT) and the
    registered workers are kept by the fleet's parent at control_url; None: a registry of
    this process's own (orchestrator/registry.py). Either way, a config with `membership`
    reads the registered workers from etcd instead (etcd_membership.py). instance: the
    id it proves on /health and whose token its /internal/ routes take (trust.py): a
    fleet's, given by its parent; None: one of its own."""

    def __init__(self, config: ClusterConfig, limits: HTTPLimits = HTTPLimits(),
                 control_url: str | None = None, instance: str | None = None):
        if not config.internal_secret:
            raise ValueError(NO_SECRET)
        self.config, self.reuse_port = config, control_url is not None
        self.gate = Gate(config.api_key, config.internal_secret, instance)
        self.isolation = CacheIsolation(config.cache_isolation,
                                        derivation_key(config.internal_secret))
        self.metrics = OrchestratorMetrics()
        self.pools = Pools(config, self.metrics)
        self.decider = Decider(config, self.metrics)
        self.ids = resume.StreamIds(config.internal_secret, config.resume_window)
        self._kv_poll: asyncio.Task | None = None
        self.registry, self.etcd = None, None
        if config.membership is not None:
            self.membership = self.etcd = EtcdMembership(
                parse_target(config.membership), self.pools.keys, self.metrics.registry)
        elif control_url is None:
            self.registry = Registry(config.remove_unhealthy_after)
            self.membership = LocalMembership(self.registry)
        else:
            self.membership = RemoteMembership(control_url, self.pools,
                                               self.pools.keys.token(self.gate.instance))
        kept = self.registry or self.etcd    # joins, leaves, lapsed leases: at once
        if kept is not None:
            kept.listeners.append(lambda: self.pools.sync(kept.listing()))
        self._registry_task: asyncio.Task | None = None
        body = config.max_body_bytes
        self.router = Router({
            "/v1/completions": Route("POST", self.generate, body),
            "/v1/chat/completions": Route("POST", self.generate, body),
            "/v1/models": Route("GET", self.models, NO_BODY),
            "/tokenize": Route("POST", self.forward, body),
            "/detokenize": Route("POST", self.forward, body),
            "/version": Route("GET", version, NO_BODY),
            "/health": Route("GET", self.health, NO_BODY),
            "/metrics": Route("GET", self.prometheus, NO_BODY),
            **{path: Route(ANY, self.internal, REGISTRATION_MAX_BODY) for path in PATHS},
        }, status_error_body)
        # Each request in flight holds a connection to a worker: both share the descriptors.
        self.max_in_flight = min(config.max_in_flight, (raise_fd_limit() - FD_HEADROOM) // 2)
        if self.max_in_flight < config.max_in_flight:
            logger.warning("orch: the file descriptor limit leaves room for %d requests in "
                           "flight (not %d); raise it (ulimit -n) for more",
                           self.max_in_flight, config.max_in_flight)
        self.http = HTTPServer(self.router.dispatch, body, "orch", limits=limits,
                               error_body=status_error_body, check_head=self.check_head,
                               other_fds=self.max_in_flight,
                               allowed_origins=config.allowed_origins)
        self.gc = ServingGC()
        self.in_flight = 0
        self.unknown = UnknownFields("orch")     # request fields no schema knows: told once

    # -- the request path -----------------------------------------------------------------
    def check_head(self, request: Request) -> Admission | Response:
        """A request whose head is in, before any of its body is read: 401 on a public route
        without the API key (when one is set), 403 on /internal/ without the internal
        secret, then its route (404, 405, 413)."""
        refusal = self.gate.key_refusal(request.path, request.header)
        if refusal is not None:
            known = isinstance(self.router.find(request), Route)
            self.metrics.requests.labels(request.path if known else "other", "refused",
                                         refusal.status).inc()
            return Response(refusal.body, refusal.status, headers=refusal.headers)
        standing = self.gate.standing(request.header)
        if request.path.startswith("/internal/") and standing < Standing.INTERNAL:
            return _error(403, NOT_INTERNAL)
        route = self.router.find(request)
        return route if isinstance(route, Response) else Admission(standing, route.max_body)

    async def generate(self, request: Request) -> Response | ChunkedStream:
        if self.in_flight >= self.max_in_flight:
            self.metrics.requests.labels(request.path, "shed", 503).inc()
            return _error(503, f"the server is at capacity ({self.in_flight} requests in "
                               f"flight); retry later", "server_error", retry_after=1)
        t0, route, status = time.time(), "disagg", 500
        self.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            body = relay.parse_body(request.body)
            relay.check_fields(body, request.path == "/v1/chat/completions", self.unknown,
                               self.config.trust_request_chat_template)
            relay.check_logprobs(request.body, body, request.path == "/v1/chat/completions")
            client = body      # as the client sent it: what a resumption must repeat
            body = relay.salted(body, self.isolation.salt(body.get("cache_salt"),
                                                          self.gate.tenant(request.header)))
            pieces = split.parts(request.body, body, request.path == "/v1/chat/completions")
            numbering = self._numbering(request, client, pieces is not None)
            served = request if numbering is None else resume.NumberedRequest(request, numbering)
            if pieces is not None:
                route = "split"
                resp = await split.Fanout(served, body, self._serve_one).run(pieces)
            else:
                resp, route = await self._serve_one(served, body, t0)
            if numbering is not None:
                resp = resume.numbered(resp, numbering)
            status = resp.status
            return resp
        except InvalidRequestError as exc:
            status = 400
            return _error(400, exc.message, param=exc.param)
        except resume.Refused as exc:
            status = exc.status
            return _error(exc.status, exc.message, param=exc.param)
        except relay.UpstreamError as exc:
            status = exc.status
            return _error(exc.status, str(exc), "server_error", retry_after=exc.retry_after)
        except ConnectionResetError:
            # The client went away mid-stream: the connection is closed, nothing is sent (and
            # no traceback logged); GEN's connection was closed on the way (pools.py).
            return Response(b"", 499)
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(request.path, route, status).inc()
            self.metrics.e2e.observe(time.time() - t0)
            if not self.config.disable_log_requests:
                log_finished("orch", request, status, t0, route)

    def _numbering(self, request: Request, body: dict, split: bool) -> resume.Numbering | None:
        """The ids of a streamed request's events (None: it does not stream), resuming after
        its Last-Event-ID if it sends one; resume.Refused: a resumption not to serve."""
        last = request.header(resume.LAST_EVENT_ID)
        if body.get("stream") is not True:
            if last is not None:
                raise resume.Refused(400, "only a streamed request (stream: true) resumes")
            return None
        tenant, digest = self.gate.tenant(request.header), resume.digest(request.path, body)
        skip, started = 0, None
        if last is not None:
            skip, started = self.ids.check(last, request.id, tenant, digest)
            reason = resume.not_reproducible(body, split)
            if reason is not None:
                raise resume.Refused(409, f"this stream cannot be resumed: {reason}", "seed")
        return resume.Numbering(self.ids.stamp(request.id, tenant, digest, started), skip)

    async def forward(self, request: Request) -> Response:
        """/tokenize and /detokenize: a generation worker's answer (Pools.forward)."""
        t0, status = time.time(), 500
        try:
            status, body = await self.pools.forward(request)
            return Response(body, status)
        except relay.UpstreamError as exc:
            status = exc.status
            return _error(exc.status, str(exc), "server_error", retry_after=exc.retry_after)
        finally:
            self.metrics.requests.labels(request.path, "forwarded", status).inc()
            if not self.config.disable_log_requests:
                log_finished("orch", request, status, t0, "forwarded")

    async def _serve_one(self, request, body: dict, t0: float | None = None):
        """(the answer, the route it took) of one request served whole on the pools: a
        client's, or one part of a split one (split.py), planned by decide.py."""
        plan = await self.decider.plan(request, body, self.pools.ctx.servers,
                                       self.pools.gen.servers)
        resp, served = await self.pools.serve(request, body, plan.local, t0 or time.time(),
                                              plan.info)
        return resp, served or ("aggregated" if plan.local else "disagg")

    def mark_down(self, url: str) -> None:
        """A worker is known to be gone (its process exited): route around it at once."""
        self.pools.mark_down(url)

    # -- small endpoints ------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        body = await self.pools.models()
        if body is not None:
            return Response(body)
        return _error(503, "no generation worker is available; retry later", "server_error",
                      retry_after=self.config.health_check_interval)

    async def health(self, request: Request) -> Response:
        """Its pools' health, and the answer to a challenge (trust.py): a worker about to
        register learns this orchestrator's instance id here, whatever the status."""
        body, status = self.pools.health()
        body["pid"] = os.getpid()     # which process of a fleet answered
        if self.etcd is not None:
            body["membership"] = self.etcd.health()
        return Response(orjson.dumps(body), status, headers=self.gate.identity(request.header))

    async def internal(self, request: Request) -> Response:
        """The worker registration API (orchestrator/registry.py): requests with this
        orchestrator's token only (check_head). A change answered here reaches this
        process's pools at once."""
        status, body = await self.membership.call(request.method, request.path, request.body)
        if status == 200:
            self.pools.sync(orjson.loads(body)["data"])
        return Response(body, status)

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.registry.render(),
                        content_type="text/plain; version=0.0.4; charset=utf-8")

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        await self.pools.start(self.membership)
        if self.registry is not None:
            self._registry_task = asyncio.create_task(self.registry.run(
                self.pools.session, self.pools.keys, self.config.health_check_interval))
            self._registry_task.add_done_callback(_report_failure)
        if self.etcd is not None:
            self._registry_task = asyncio.create_task(self.etcd.run(self.pools.session))
            self._registry_task.add_done_callback(_report_failure)
        self._kv_poll = asyncio.create_task(self.decider.poll(self.pools.session, self.pools))
        self._kv_poll.add_done_callback(_report_failure)
        self.gc.start()
        # backlog: connections a burst may open before the loop accepts them
        await self.http.start(self.config.host, self.config.port, LISTEN_BACKLOG,
                              reuse_port=self.reuse_port)
        logger.info("orch: serving on http://%s:%d (ctx: %s; gen: %s)", self.config.host,
                    self.http.port, ", ".join(s.url for s in self.pools.ctx.servers),
                    ", ".join(s.url for s in self.pools.gen.servers))

    async def stop(self) -> None:
        await self.http.close()
        self.gc.stop()
        self._kv_poll.cancel()
        self.decider.close()
        if self._registry_task is not None:
            self._registry_task.cancel()
        await self.pools.stop()


async def version(request: Request) -> Response:
    return Response(orjson.dumps({"version": __version__}))


def _error(status: int, message: str, type: str = "invalid_request_error",
           param: str | None = None, retry_after: float | None = None) -> Response:
    headers = None if retry_after is None else {"Retry-After": str(max(1, round(retry_after)))}
    return Response(error_body(message, type, param), status, headers=headers)


def _report_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("orch: %s stopped", task.get_coro().__qualname__, exc_info=task.exception())


async def run_orchestrator(config: ClusterConfig, should_stop=None, banner: str = "",
                           companion=None, **options) -> None:
    """Serve until Ctrl-C / SIGTERM (or should_stop() turns true). companion: a coroutine
    function of the Orchestrator run alongside it (`splitserve up` watches its workers),
    cancelled first on the way out. options: Orchestrator's (control_url, instance)."""
    orch = Orchestrator(config, **options)
    await orch.start()
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
        await orch.stop()
