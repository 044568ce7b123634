"""The worker's HTTP front-end: aiohttp on uvloop, one engine-core process behind it."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
from aiohttp import web

from splitserve.errors import InvalidRequestError
from splitserve.gc_policy import ServingGC
from splitserve.model.loader import load_model_source
from splitserve.protocol.openai import error_body
from splitserve.server.config import LISTEN_BACKLOG, ServerConfig
from splitserve.server.engine_client import EngineClient, EngineDeadError
from splitserve.server.generate import GenerateHandlers
from splitserve.server.metrics import ServerMetrics
from splitserve.signals import wait_for_stop_signal

logger = logging.getLogger(__name__)


class ModelNotFound(InvalidRequestError):
    pass


class _TokenizeBody(msgspec.Struct):
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True


class _DetokenizeBody(msgspec.Struct):
    tokens: list[int]


class WorkerServer:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.engine = EngineClient(config.engine, log_prefix=config.log_prefix)
        # The front-end needs only the tokenizer; weights are read by the engine process.
        self.tokenizer = load_model_source(config.engine.model).tokenizer
        self.pool = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
        self.gc = ServingGC()
        self.metrics = ServerMetrics()
        self.model_name = config.served_model_name
        self.token_text = functools.lru_cache(maxsize=65536)(
            lambda i: self.tokenizer.decode([i], skip_special_tokens=False))
        self.created = int(time.time())
        gen = GenerateHandlers(self)
        self.app = web.Application(client_max_size=config.max_body_bytes,
                                   middlewares=[self._errors])
        self.app.add_routes([
            web.post("/v1/completions", gen.completions),
            web.post("/v1/chat/completions", gen.chat),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/metrics", self.prometheus),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
        ])

    async def in_pool(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ModelNotFound(f"the model `{name}` does not exist; this server serves "
                                f"`{self.model_name}`", "model")

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        """Every failure becomes an OpenAI-style error body; nothing escapes as a traceback."""
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except ModelNotFound as exc:
            status = 404
            return _error(404, exc.message, "NotFoundError", exc.param, "model_not_found")
        except InvalidRequestError as exc:
            status = 400
            return _error(400, exc.message, "invalid_request_error", exc.param)
        except EngineDeadError as exc:
            status = 503
            return _error(503, f"engine is not running: {exc}", "server_error")
        except web.HTTPException as exc:
            status = exc.status
            kind = "invalid_request_error" if exc.status < 500 else "server_error"
            return _error(exc.status, exc.reason if exc.status != 413 else
                          f"request body too large (limit {self.config.max_body_bytes} bytes)", kind)
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499   # the client went away
            raise
        except Exception as exc:
            logger.exception("%s: request failed", self.config.log_prefix)
            return _error(500, f"internal error: {exc}", "server_error")
        finally:
            self.metrics.request_done(request.path, status)

    # -- small endpoints ------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        ready = self.engine.ready
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "splitserve", "max_model_len": ready.max_model_len if ready else None}]})

    async def health(self, request: web.Request) -> web.Response:
        if self.engine.healthy:
            body = {"status": "ok", "role": self.config.role}
            if self.config.engine.kv.bench_skip_pull:   # `bench frontend --url` checks this
                body["bench_skip_kv_pull"] = True
            return web.json_response(body)
        return _error(503, f"engine is not running: {self.engine.dead_reason or 'starting'}",
                      "server_error")

    async def prometheus(self, request: web.Request) -> web.Response:
        self.metrics.update_engine(self.engine.stats)
        self.metrics.update_process()
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = _decode(_TokenizeBody, await request.read())
        tok = self.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("send exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            text = await self.in_pool(lambda: tok.apply_chat_template(body.messages))
            ids = await self.in_pool(lambda: tok.encode(text, add_special_tokens=False))
        else:
            ids = await self.in_pool(lambda: tok.encode(body.prompt, body.add_special_tokens))
        return web.json_response({"tokens": ids.tolist(), "count": len(ids),
                                  "max_model_len": self.engine.ready.max_model_len})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = _decode(_DetokenizeBody, await request.read())
        bad = [t for t in body.tokens if not 0 <= t < self.engine.ready.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids outside the vocabulary: {bad[:5]}", "tokens")
        text = await self.in_pool(lambda: self.tokenizer.decode(body.tokens))
        return web.json_response({"prompt": text})

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> web.AppRunner:
        ready = await self.engine.start(self.config.engine_start_timeout)
        self.model_name = self.model_name or ready.model_name
        self.gc.start()
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await runner.setup()
        # backlog: connections a burst may open before the loop accepts them
        await web.TCPSite(runner, self.config.host, self.config.port, backlog=LISTEN_BACKLOG).start()
        logger.info("%s: serving %s (%s) on http://%s:%d", self.config.log_prefix, ready.model_name,
                    ready.dtype, self.config.host, self.config.port)
        return runner

    async def run(self) -> None:
        runner = await self.start()
        try:
            await wait_for_stop_signal()
        finally:
            await runner.cleanup()
            self.gc.stop()
            await self.engine.shutdown()
            self.pool.shutdown(wait=False)


def _error(status: int, message: str, type: str, param: str | None = None,
           code: str | None = None) -> web.Response:
    return web.Response(status=status, body=error_body(message, type, param, code),
                        content_type="application/json")


def _decode(struct, body: bytes):
    try:
        return msgspec.json.decode(body, type=struct)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(str(exc)) from None
    except msgspec.DecodeError:
        raise InvalidRequestError("the request body is not valid JSON") from None


def serve(config: ServerConfig) -> None:
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    run(WorkerServer(config).run())
