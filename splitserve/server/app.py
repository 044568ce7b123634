"""The worker's HTTP front-end: splitserve.httpd on uvloop, one engine-core process behind it
(which, with `--api-server-count N`, N front-end processes share: server/frontends.py)."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec

from splitserve.grammar_compile import GrammarCompiler
from splitserve.errors import InvalidRequestError
from splitserve.gc_policy import ServingGC
from splitserve.httpd import ChunkedStream, HTTPServer, Request, Response, json_response
from splitserve.httpd.limits import LISTEN_BACKLOG
from splitserve.httpd.router import NO_BODY, Route, Router
from splitserve.httpd.server import Admission
from splitserve.model.loader import load_model_source
from splitserve.protocol.cache_salt import CacheIsolation, derivation_key
from splitserve.protocol.internal_api import KV_BLOCKS_PATH, load_body
from splitserve.protocol.openai import error_body, status_error_body
from splitserve.protocol.openai_requests import decode_tokenize_request
from splitserve.protocol.tool_parsers import family_parser, get_parser
from splitserve.protocol.tool_template import describe as describe_tools, tool_tokenizer
from splitserve.protocol.prompts import chat_prompt, encode_prompt, with_template_file
from splitserve.request_log import Totals, log_finished, log_throughput
from splitserve.server.config import ServerConfig
from splitserve.server.drain import drain
from splitserve.server.engine_client import EngineClient, EngineDeadError
from splitserve.server.engine_link import EngineLink
from splitserve.server.etcd_registration import EtcdRegistration
from splitserve.server.generate import GenerateHandlers
from splitserve.server.kv_blocks import kv_blocks_response
from splitserve.server.metrics import ServerMetrics
from splitserve.server.registration import Registration, own_url
from splitserve.signals import wait_for_stop_signal
from splitserve.trust import Gate, NotInternal, Refusal, forbidden
from splitserve.version import __version__

logger = logging.getLogger(__name__)

RETRY_AFTER = "1"   # seconds a refused client is asked to wait (overloaded, restarting)
REPORT_SECONDS = 0.5   # how often a front-end of several reports its metrics to the others


class ModelNotFound(InvalidRequestError):
    pass


class Overloaded(RuntimeError):
    """More requests wait for the engine than the worker is configured to hold: 503."""


class Draining(Overloaded):
    """The worker is stopping (server/drain.py): 503, another worker takes the request."""


class _DetokenizeBody(msgspec.Struct):
    tokens: list[int]


class WorkerServer:
    """engine: the EngineClient it owns (by default), or, as one of several front-ends, a
    PeerEngineClient (server/peer_client.py) over the engine the serve process owns."""

    def __init__(self, config: ServerConfig, engine: EngineLink | None = None):
        self.config = config
        self.engine = engine or EngineClient(config.engine, log_prefix=config.log_prefix,
                                             stall_seconds=config.engine_stall_seconds)
        self.log_prefix = self.engine.log_prefix
        self._reporter: asyncio.Task | None = None
        self._stats_log: asyncio.Task | None = None
        self.draining = False     # stopping: new generation requests are refused (drain.py)
        # The front-end needs only the tokenizer; weights are read by the engine process.
        source = load_model_source(config.engine.model, config.engine.load_format)
        self.tokenizer = with_template_file(source.tokenizer, config.chat_template)
        self.pool = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
        # Structured output: every grammar is compiled here, in the pool, before its request
        # reaches the engine (a bad one is a 400); cached by spec.
        self.grammars = GrammarCompiler(self.tokenizer.to_json(), self.tokenizer.vocab_size,
                                        self.tokenizer.eos_token_ids)
        # Tool calling: the format calls are parsed from (protocol/tool_parsers)
        self.tool_parser = get_parser(config.tool_call_parser or family_parser(
            tool_tokenizer(self.tokenizer).chat_template))
        self.gc = ServingGC()
        self.metrics = ServerMetrics()
        self.model_name = config.served_model_name
        self.token_text = functools.lru_cache(maxsize=65536)(
            lambda i: self.tokenizer.decode([i], skip_special_tokens=False))
        self.created = int(time.time())
        self.gate = Gate(config.api_key, config.internal_secret, config.instance_id)
        self.isolation = CacheIsolation(config.cache_isolation,
                                        derivation_key(config.internal_secret))
        self.handlers = gen = GenerateHandlers(self)
        body = config.max_body_bytes
        self.router = Router({
            "/v1/completions": Route("POST", gen.completions, body),
            "/v1/chat/completions": Route("POST", gen.chat, body),
            "/v1/models": Route("GET", self.models, NO_BODY),
            "/health": Route("GET", self.health, NO_BODY),
            "/metrics": Route("GET", self.prometheus, NO_BODY),
            "/version": Route("GET", self.version, NO_BODY),
            "/tokenize": Route("POST", self.tokenize, body),
            "/detokenize": Route("POST", self.detokenize, body),
            KV_BLOCKS_PATH: Route("GET", functools.partial(kv_blocks_response, gate=self.gate,
                                                           engine=self.engine), NO_BODY),
        }, status_error_body)
        self.http = HTTPServer(self.dispatch, body, self.log_prefix, limits=config.http,
                               error_body=status_error_body, check_head=self.check_head,
                               allowed_origins=config.allowed_origins)

    async def in_pool(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)

    def admit(self) -> None:
        """Refuse a generation request at once, before any work is spent on it, when the
        engine is down, too many requests wait for it, or the worker is stopping (503 with
        Retry-After)."""
        if self.draining:
            raise Draining("this worker is stopping; retry on another")
        self.engine.check_available()
        waiting = self.engine.num_waiting
        if waiting >= self.config.max_waiting_requests:
            self.metrics.shed.inc()
            raise Overloaded(f"the server is overloaded ({waiting} requests are waiting); "
                             f"retry shortly")

    def in_flight(self) -> int:
        """Generation requests open in this worker: in every front-end process (the others'
        as of their last report, at most REPORT_SECONDS old)."""
        return self.engine.in_flight

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ModelNotFound(f"the model `{name}` does not exist; this server serves "
                                f"`{self.model_name}`", "model")

    def check_head(self, request: Request) -> Admission | Response:
        """A request whose head is in, before any of its body is read: 401 on a public route
        without the API key (or this worker's internal token), then its route (404, 405, 413)."""
        refusal = self.gate.key_refusal(request.path, request.header, accept_internal=True)
        route = self.router.find(request)
        answer = _refused(refusal) if refusal is not None else route
        if isinstance(answer, Response):
            self.metrics.request_done(request.path if isinstance(route, Route) else "other",
                                      answer.status)
            return answer
        return Admission(self.gate.standing(request.header), route.max_body)

    async def dispatch(self, request: Request) -> Response | ChunkedStream:
        """Serve a request whose head passed check_head; every failure becomes an
        OpenAI-style error body, nothing escapes as a traceback. An answer to a request whose
        internal token checked out carries the response proof (a stream's head carries it:
        generate.py)."""
        response = await self._answer(request)
        if type(response) is Response and self.gate.token is not None:
            response.headers = self.gate.proven(request.header, response.headers)
        return response

    async def _answer(self, request: Request) -> Response | ChunkedStream:
        status, started = 500, time.time()
        try:
            refusal = self.gate.body_refusal(request.header, request.body)
            response = (_refused(refusal) if refusal is not None
                        else await self.router.dispatch(request))
            status = response.status
            return response
        except NotInternal:
            status = 403
            return _refused(forbidden(self.gate.token is not None))
        except ModelNotFound as exc:
            status = 404
            return _error(404, exc.message, "NotFoundError", exc.param, "model_not_found")
        except InvalidRequestError as exc:
            status = 400
            return _error(400, exc.message, "invalid_request_error", exc.param)
        except (EngineDeadError, Overloaded) as exc:
            status = 503
            return _error(503, str(exc), "server_error", headers={"Retry-After": RETRY_AFTER})
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499   # the client went away
            raise
        except Exception:
            logger.exception("%s: request %s failed", self.log_prefix, request.id)
            return _error(500, "internal error; the request was not completed", "server_error")
        finally:
            self.metrics.request_done(request.path, status)
            if not self.config.disable_log_requests:
                log_finished(self.log_prefix, request, status, started)

    # -- small endpoints ------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        ready = self.engine.ready
        return json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "splitserve", "max_model_len": ready.max_model_len if ready else None}]})

    async def health(self, request: Request) -> Response:
        """Up or not, and the answer to a challenge (trust.py) whichever it is."""
        problem = "draining: this worker is stopping" if self.draining else self.engine.health()
        if problem is None:
            # `bench frontend --url` refuses a worker whose KV backend is not `none`
            response = json_response({"status": "ok", "role": self.config.role,
                                      "kv_backend": self.config.engine.kv.backend,
                                      "load": self.load()})
        else:
            response = _error(503, problem, "server_error")
        response.headers = self.gate.identity(request.header)
        return response

    def load(self) -> dict:
        """GET /health's "load": the engine's running and waiting requests and KV use
        (engine-wide), and the worker's generation requests open: this front-end's, from
        arrival, and the other front-ends' (--api-server-count) as they last reported."""
        now = self.totals()
        return load_body(now.running, now.waiting,
                         self.handlers.in_flight + self.engine.peers_in_flight(), now.kv_usage,
                         self.engine.stats.num_prefill_tokens)

    async def prometheus(self, request: Request) -> Response:
        self.metrics.update_engine(self.engine.stats)
        self.metrics.engine_restarts.set_total(self.engine.restarts)
        self.metrics.update_process()
        peers = {k: r.metrics for k, r in self.engine.peer_reports.items()}
        return Response(self.metrics.render(peers, self.engine.peer),
                        content_type="text/plain; version=0.0.4; charset=utf-8")

    async def version(self, request: Request) -> Response:
        return json_response({"version": __version__})

    async def tokenize(self, request: Request) -> Response:
        body = decode_tokenize_request(request.body)
        tok, max_len = self.tokenizer, self.engine.ready.max_model_len
        if body.messages is not None:   # as chat completions makes them
            _, ids = await self.in_pool(lambda: chat_prompt(tok, body, max_len))
        else:
            ids = await self.in_pool(lambda: encode_prompt(tok, body.prompt, max_len, "prompt",
                                                           body.add_special_tokens))
        return json_response({"tokens": ids.array.tolist(), "count": len(ids),
                              "max_model_len": max_len})

    async def detokenize(self, request: Request) -> Response:
        body = _decode(_DetokenizeBody, request.body)
        bad = [t for t in body.tokens if not 0 <= t < self.engine.ready.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids outside the vocabulary: {bad[:5]}", "tokens")
        text = await self.in_pool(lambda: self.tokenizer.decode(body.tokens))
        return json_response({"prompt": text})

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        ready = await self.engine.start(self.config.engine_start_timeout)
        self.model_name = self.model_name or ready.model_name
        self.gc.start()
        # backlog: connections a burst may open before the loop accepts them; several
        # front-ends share the port (SO_REUSEPORT; server/frontends.py says why)
        shared = self.engine.peer > 0
        await self.http.start(self.config.host, self.config.port, LISTEN_BACKLOG,
                              reuse_port=shared)
        if shared:
            self._reporter = asyncio.create_task(self._report())
        if not self.config.disable_log_stats:
            self._stats_log = asyncio.create_task(log_throughput(self.log_prefix, self.totals))
        logger.info("%s: serving %s (%s) on http://%s:%d%s", self.log_prefix, ready.model_name,
                    ready.dtype, self.config.host, self.http.port,
                    f" (front-end {self.engine.peer}, pid {os.getpid()})" if shared else "")
        logger.info("%s: tool calls: %s parser; %s", self.log_prefix, self.tool_parser.name,
                    describe_tools(self.tokenizer))
        # One registration per worker: front-end 1 speaks for the others on the same port.
        self.registration = self._join() if self.engine.peer <= 1 else None

    def _join(self):
        """Where this worker keeps itself in the cluster: etcd (--membership), an
        orchestrator (--register), or nowhere (None)."""
        if self.config.membership:
            return EtcdRegistration.start(self.config, own_url(self.config.host, self.http.port),
                                          lambda: self.engine.ready, self.model_name)
        return Registration.start(self.config, self.http.port)

    def totals(self) -> Totals:
        """The throughput line's counts: this front-end's tokens, the engine's requests."""
        stats, total = self.engine.stats, self.engine.stats.kv_blocks_total
        return Totals(self.metrics.prompt_tokens.total, self.metrics.generation_tokens.total,
                      stats.num_running, stats.num_waiting,
                      stats.kv_blocks_used / total if total else 0.0)

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(REPORT_SECONDS)
            self.metrics.update_process()
            self.engine.report(self.metrics.frontend_state())

    async def stop(self) -> None:
        await Registration.leave(getattr(self, "registration", None))
        if self.engine.healthy:
            await drain(self, self.config.drain_grace_seconds)
        for task in (self._reporter, self._stats_log):
            if task is not None:
                task.cancel()
        await self.http.close()
        self.gc.stop()
        await self.engine.shutdown()
        self.pool.shutdown(wait=False)

    async def run(self) -> None:
        await self.start()
        try:
            # a front-end of several also stops when the serve process is gone
            await wait_for_stop_signal(lambda: getattr(self.engine, "parent_gone", False))
        finally:
            await self.stop()


def _error(status: int, message: str, type: str, param: str | None = None,
           code: str | None = None, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(message, type, param, code), status, headers=headers)


def _refused(refusal: Refusal) -> Response:
    return Response(refusal.body, refusal.status, headers=refusal.headers)


def _decode(struct, body: bytes):
    try:
        return msgspec.json.decode(body, type=struct)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(str(exc)) from None
    except msgspec.DecodeError:
        raise InvalidRequestError("the request body is not valid JSON") from None
    except RecursionError:
        raise InvalidRequestError("the request body nests arrays or objects too deeply") from None


def run_loop(main) -> None:
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    run(main)


def serve(config: ServerConfig) -> None:
    if config.api_server_count > 1:
        from splitserve.server.frontends import serve_frontends
        serve_frontends(config)
    else:
        run_loop(WorkerServer(config).run())
