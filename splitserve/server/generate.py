"""/v1/completions and /v1/chat/completions: prompts in, engine deltas out as JSON or SSE.

Event-loop budget: decoding the body (msgspec) and shaping the response are the only
per-request work here; tokenization and chat templates run in the tokenizer thread pool.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from contextlib import aclosing
from typing import AsyncIterator

import numpy as np

from splitserve.errors import InvalidRequestError
from splitserve.httpd import ChunkedStream, Request, Response
from splitserve.protocol.block_hashes import salted_root
from splitserve.protocol.disagg import (
    DisaggregatedParams, handoff_comment, ids_comment, relayed_handle)
from splitserve.protocol.engine import CompletionDelta, EngineRequest, RemotePrefill, RequestKind
from splitserve.protocol.internal_api import SENT_AT_HEADER
from splitserve.protocol.openai import (
    DONE, ChatCompletionRequest, CompletionRequest, EchoPrompt, ResponseAccumulator,
    StreamEncoder, decode_chat_request, decode_completion_request, response_id, sse_error)
from splitserve.protocol.openai_fields import UnknownFields, refuse_request_template
from splitserve.protocol.prompts import chat_prompt, encode_prompt
from splitserve.protocol.tools import NONE, with_tools
from splitserve.sampling_params import SamplingParams
from splitserve.server.admission import (
    engine_requests, logprob_entries, relay_fields, relayed_prompt, request_kind)
from splitserve.server.engine_client import EngineDeadError
from splitserve.tokens import PromptTokens
from splitserve.trust import Gate, NotInternal

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# Logprob entries a response body may carry and still be built on the event loop: ~4 us
# each in chat (~4 ms for these), more than the hop to the tokenizer pool costs.
ON_LOOP_MAX_ENTRIES = 1024


def _counted(handler):
    """in_flight counts a generation request from its arrival to its last byte sent."""
    @functools.wraps(handler)
    async def counted(self, request):
        self.in_flight += 1
        try:
            return await handler(self, request)
        finally:
            self.in_flight -= 1
    return counted


class GenerateHandlers:
    def __init__(self, server):
        self.server = server          # server.app.WorkerServer: engine, tokenizer, metrics
        self.in_flight = 0
        self.unknown = UnknownFields(server.config.log_prefix)   # warned once per name

    @_counted
    async def completions(self, request: Request) -> Response | ChunkedStream:
        arrival = _arrival(request, self.server.gate)
        self.server.admit()
        req = decode_completion_request(request.body, self.unknown)
        self._internal_only(request, req)
        self.server.check_model(req.model)
        params = req.sampling_params()
        await self._check_grammar(params)
        if request_kind(req) == RequestKind.GENERATION_ONLY:
            (prompts, remote), texts = self._relayed(req, params), None
        else:
            (prompts, texts), remote = await self._completion_prompts(req), None
        requests = self._engine_requests(request, req, prompts, params, remote)
        echo = await self._echo(prompts, texts) if req.echo else ()
        return await self._respond(request, req, requests, echo, arrival)

    @_counted
    async def chat(self, request: Request) -> Response | ChunkedStream:
        arrival = _arrival(request, self.server.gate)
        self.server.admit()
        req = decode_chat_request(request.body, self.unknown)
        refuse_request_template(req.chat_template, self.server.config.trust_request_chat_template)
        self._internal_only(request, req)
        self.server.check_model(req.model)
        params, schemas = with_tools(req, req.sampling_params(), self.server.tool_parser)
        await self._check_grammar(params, schemas)
        if request_kind(req) == RequestKind.GENERATION_ONLY:
            prompts, remote = self._relayed(req, params)
        else:
            prompts, remote = [await self._chat_prompt(req)], None
        requests = self._engine_requests(request, req, prompts, params, remote)
        return await self._respond(request, req, requests, (), arrival)

    async def _check_grammar(self, params: SamplingParams, specs=()) -> None:
        """Structured output: the grammar compiles (cached by spec), in the tokenizer pool,
        within grammar_compile_seconds, or the request is a 400 naming its field before it
        reaches the engine; so do `specs` first (a tool-calling request's schemas:
        protocol/tools.with_tools). A compile past the bound goes on in its thread (its
        work is bounded by llguidance's fuel) and is cached for the next request."""
        grammars, limit = self.server.grammars, self.server.config.grammar_compile_seconds
        for spec in [*specs, *([params.grammar] if params.grammar is not None else [])]:
            if grammars.cached(spec) is not None:
                continue
            try:
                await asyncio.wait_for(self.server.in_pool(lambda s=spec: grammars.check(s)),
                                       limit)
            except TimeoutError:
                raise InvalidRequestError(f"{spec.field}: compiling the grammar took longer "
                                          f"than {limit:g} s", spec.field) from None

    def _tool_parser(self, req):
        """The parser a chat answer's tool calls are read with; None: they are not."""
        parsed = isinstance(req, ChatCompletionRequest) and req.tool_mode != NONE
        return self.server.tool_parser if parsed else None

    def _internal_only(self, request: Request, req) -> None:
        """The front door (WorkerServer.dispatch) refused a body carrying
        disaggregated_params without the internal token; this checks what was decoded."""
        if req.disaggregated_params is not None and not self.server.gate.internal(request.header):
            raise NotInternal()

    def _relayed(self, req, params) -> tuple[list[PromptTokens], RemotePrefill]:
        """generation_only: the prompt as the context worker relayed it, counted by mode."""
        prompts, remote, mode = relayed_prompt(req, params)
        self.server.metrics.token_relay.labels(mode).inc()
        return prompts, remote

    async def _chat_prompt(self, req: ChatCompletionRequest) -> PromptTokens:
        tok, max_len = self.server.tokenizer, self.server.engine.ready.max_model_len
        _, prompt = await self.server.in_pool(lambda: chat_prompt(tok, req, max_len))
        return prompt

    async def _completion_prompts(self, req: CompletionRequest):
        """The prompts' tokens, and their texts where they came as text (else None)."""
        items, tok = req.prompts(), self.server.tokenizer
        if isinstance(items[0], str):
            max_len = self.server.engine.ready.max_model_len
            special = req.add_special_tokens
            prompts = await self.server.in_pool(
                lambda: [encode_prompt(tok, p, max_len, "prompt", special) for p in items])
            return prompts, items
        return [PromptTokens.from_list(ids) for ids in items], None

    async def _echo(self, prompts: list[PromptTokens], texts: list[str] | None):
        """echo: each prompt's text, decoded in the tokenizer pool where only its ids came;
        a length-only prompt's ids come back from the engine (ECHO_BACK)."""
        if prompts[0].is_placeholder:
            return ECHO_BACK
        if texts is None:
            tok = self.server.tokenizer
            texts = await self.server.in_pool(
                lambda: [tok.decode(p.array, skip_special_tokens=False) for p in prompts])
        return [EchoPrompt(t, int(p.array[0])) for p, t in zip(prompts, texts)]

    def _engine_requests(self, request: Request, req, prompts: list[PromptTokens],
                         params: SamplingParams, remote: RemotePrefill | None):
        """The validated request's EngineRequests (every check that answers 400 first), under
        a new response id, with the hash root of its effective salt (a public client's under
        --cache-isolation api_key is derived from its key)."""
        salt = self.server.isolation.salt(req.cache_salt, self.server.gate.tenant(request.header))
        return engine_requests(req, response_id(isinstance(req, ChatCompletionRequest)), prompts,
                               params, self.server.engine.ready, remote, salted_root(salt))

    async def _respond(self, request: Request, req, requests: list[EngineRequest], echo,
                       arrival: float):
        """Submits the requests and shapes their deltas into the response: SSE, or one JSON
        body (with the disaggregated_params of a context_only handoff). Its id is the first
        request's."""
        prompts = [r.prompt for r in requests]
        kwargs = dict(token_text=self.server.token_text, echo=echo,
                      request_id=requests[0].request_id, tool_parser=self._tool_parser(req))
        resumed = requests[0].resumed
        if kwargs["tool_parser"] is not None and resumed is not None:
            # a stream continued on this worker: its tool calls read on from the text so far
            kwargs["tool_prefix"] = await self.server.in_pool(
                lambda: self.server.tokenizer.decode(resumed.array))
        deltas = self._merged(requests)
        if echo is ECHO_BACK:
            deltas, echo = await echo_back(deltas, self.server)
            kwargs["echo"] = echo
        observe = _Observer(self.server.metrics, arrival, requests[0].remote is not None)
        request.outcome = observe     # what the request's log line says (server/app.py)
        if req.stream:
            return await self._stream(request, req, deltas, observe, kwargs, len(prompts[0]))
        acc = ResponseAccumulator(req, self.server.model_name, num_prompts=len(prompts), **kwargs)
        handoff = None
        async with aclosing(deltas):
            async for i, delta in deltas:
                observe(i, delta)
                acc.add(delta, i)
                handoff = handoff or (delta if delta.kv_handle is not None else None)
        failed = acc.error_response()
        if failed is not None:
            return Response(failed[1], failed[0])
        extra = None if handoff is None else _handoff_params(req, handoff, prompts[0])
        entries = logprob_entries(prompts, requests[0].params, acc.usage.completion)
        if entries <= ON_LOOP_MAX_ENTRIES:
            return Response(acc.body(extra))
        # up to MAX_LOGPROB_ENTRIES entries to shape: seconds of CPU, in the pool
        return Response(await self.server.in_pool(lambda: acc.body(extra)))

    async def _stream(self, request, req, deltas, observe, kwargs,
                      prompt_len: int) -> ChunkedStream:
        """The head goes out first; whatever fails after it (the engine died, a bug) ends
        the stream with an error event and [DONE], never a silent close. A stream the
        draining engine handed off ends with the handoff comment instead, and no [DONE]."""
        enc = StreamEncoder(req, self.server.model_name, **kwargs)
        tag_ids = bool(req.disaggregated_params and req.disaggregated_params.stream_token_ids)
        resp = request.stream(self.server.gate.proven(request.header, SSE_HEADERS))
        try:
            async with aclosing(deltas):
                async for i, delta in deltas:
                    if delta.kv_handle is not None and tag_ids:
                        await resp.write(handoff_comment(_moved_params(delta, prompt_len)))
                        resp.end()
                        return resp
                    observe(i, delta)
                    chunk = enc.chunk(delta, i)
                    if tag_ids and delta.token_ids:
                        chunk = ids_comment(delta.token_ids) + chunk
                    if chunk:
                        await resp.write(chunk)
                    if delta.error is not None:
                        break
        except ConnectionResetError:   # the client went away: nobody to tell
            raise
        except EngineDeadError as exc:
            await resp.write(sse_error(str(exc)))
        except Exception:
            logger.exception("%s: request %s: stream failed", self.server.config.log_prefix,
                             request.id)
            await resp.write(sse_error("internal error; this request was not completed"))
        if req.include_usage:
            await resp.write(enc.usage_chunk())
        await resp.write(DONE)
        resp.end()
        return resp

    async def _merged(self, requests: list[EngineRequest],
                      ) -> AsyncIterator[tuple[int, CompletionDelta]]:
        """(prompt index, delta) of every prompt's engine request, as they come."""
        engine = self.server.engine
        if len(requests) == 1:
            async for delta in engine.generate(requests[0]):
                yield 0, delta
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for delta in engine.generate(requests[i]):
                    q.put_nowait((i, delta))
            except Exception as exc:   # (the engine died) fails the whole request, below
                q.put_nowait((i, exc))
            else:
                q.put_nowait((i, None))
        tasks = [asyncio.create_task(pump(i)) for i in range(len(requests))]
        try:
            open_prompts = len(tasks)
            while open_prompts:
                i, delta = await q.get()
                if isinstance(delta, Exception):
                    raise delta
                if delta is None:
                    open_prompts -= 1
                else:
                    yield i, delta
        finally:   # leaving early (client gone, error) aborts whatever is still running
            for t in tasks:
                t.cancel()


class _Observer:
    """Latency and token metrics of one HTTP request, recorded as its deltas pass (a plain
    call per delta: one async generator fewer on the hot path); its totals (prompt_tokens,
    completion_tokens, ttft: None until a token came) are the request's log line."""

    __slots__ = ("m", "arrival", "generation_only", "last", "prompt_tokens",
                 "completion_tokens", "ttft")

    def __init__(self, metrics, arrival: float, generation_only: bool):
        self.m, self.arrival, self.generation_only = metrics, arrival, generation_only
        self.last: dict[tuple[int, int], float] = {}
        self.prompt_tokens = self.completion_tokens = 0
        self.ttft: float | None = None

    def __call__(self, i: int, delta: CompletionDelta) -> None:
        m, now = self.m, delta.received or time.time()
        if delta.token_ids:
            prev = self.last.get((i, delta.index))
            if prev is None:
                self._first_token(delta, now)
            else:
                m.itl.observe(now - prev)
            self.last[(i, delta.index)] = now
            m.generation_tokens.inc(len(delta.token_ids))
            self.completion_tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            m.e2e.observe(now - self.arrival)

    def _first_token(self, delta: CompletionDelta, now: float) -> None:
        """A response sent whole gets one delta per sequence (the engine's final-only
        output): its first token's time comes with it, and it has no inter-token gaps."""
        m, admitted = self.m, max(delta.admit_time - self.arrival, 0.0)
        ttft = (delta.first_token_time or now) - self.arrival
        m.ttft.observe(ttft)
        self.ttft = ttft if self.ttft is None else min(self.ttft, ttft)
        m.queue.observe(delta.queue_time)
        m.prefill.observe(delta.prefill_time)
        if delta.index == 0:
            m.prompt_tokens.inc(delta.num_prompt_tokens)
            self.prompt_tokens += delta.num_prompt_tokens
            m.preprocessing.observe(admitted)
        if self.generation_only:
            m.gen_preprocessing.observe(admitted)
            m.kv_transfer.observe(delta.kv_transfer_time)


def _moved_params(handoff: CompletionDelta, prompt_len: int) -> DisaggregatedParams:
    """A draining worker's stream: what continues it on another generation worker, with the
    tokens it streamed (the orchestrator has them) as resume_token_ids. Length only: a
    stream whose prompt values are read is not moved (engine/disagg.can_move)."""
    handle = handoff.kv_handle
    return DisaggregatedParams(request_type="generation_only", prompt_len=prompt_len,
                               ctx_request_id=handle.ctx_request_id, kv_handle=handle,
                               token_relay="metadata")


def _handoff_params(req, handoff: CompletionDelta, prompt: PromptTokens) -> dict:
    """context_only: what the answer tells the orchestrator to relay to a generation worker."""
    relay = req.disaggregated_params.token_relay
    return {"disaggregated_params": DisaggregatedParams(
        request_type="context_only", ctx_request_id=handoff.kv_handle.ctx_request_id,
        first_gen_tokens=handoff.token_ids, first_gen_logprobs=handoff.logprobs,
        prompt_len=len(prompt), kv_handle=relayed_handle(handoff.kv_handle, relay),
        token_relay=relay, **relay_fields(relay, prompt))}


ECHO_BACK = ("echo the prompt the engine hands back",)


async def echo_back(deltas, server) -> tuple[AsyncIterator, list[EchoPrompt]]:
    """echo of a length-only prompt: its ids come with the first delta, as raw int32 bytes
    (the engine pulled them with the KV); their text is decoded in the tokenizer pool before
    anything is sent. Returns the deltas (the first one again) and the echo."""
    try:
        first = await anext(deltas)
    except BaseException:
        await deltas.aclose()
        raise
    echo = []
    if first[1].prompt_bytes:
        ids = np.frombuffer(first[1].prompt_bytes, dtype="<i4")
        text = await server.in_pool(lambda: server.tokenizer.decode(ids, skip_special_tokens=False))
        echo = [EchoPrompt(text, int(ids[0]))]

    async def again():
        async with aclosing(deltas):
            yield first
            async for item in deltas:
                yield item
    return again(), echo


SENT_AT_MAX_AGE = 3600.0    # seconds: an X-Sent-At older than this is not believed


def _arrival(request: Request, gate: Gate) -> float:
    """When the sender wrote the request (its X-Sent-At header), else now: so time queued in
    front of this event loop counts in the preprocessing metrics. Only an internal request
    (the orchestrator's, a benchmark's with the secret) is believed, and only a time in the
    last hour: a public client's header, a clock ahead of ours, NaN or inf would skew every
    histogram's sum for good."""
    now = time.time()
    sent = request.header(SENT_AT_HEADER)
    if not sent or not gate.internal(request.header):
        return now
    try:
        at = float(sent)
    except ValueError:
        return now
    return at if now - SENT_AT_MAX_AGE <= at <= now else now
