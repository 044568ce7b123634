"""A request the split path serves as several: a batch of prompts (completions' `prompt` as
a list of prompts) and `n > 1` become one single-prompt, single-choice request per choice,
each served on its own (prefill on a CTX, decode on a GEN), and their answers merge back in
the order a worker gives them: choice index = prompt index * n + choice, usage summed (a
prompt's tokens counted once, whatever its n).

Choice j of n samples with the seed a worker's sibling j would (sampling_params.sibling_seed),
so a seeded request answers through the split as it would whole on one worker.

Only such requests have their workers' answers parsed here: the merged stream's events are
rewritten (choice index, response id) and its usage chunk is the parts' summed.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, NamedTuple

import orjson

from splitserve.httpd import ChunkedStream, Response
from splitserve.orchestrator.relay import SSE, UpstreamError
from splitserve.protocol.openai import DONE, error_body, sse_error
from splitserve.protocol.openai_requests import decode_chat_request, decode_completion_request
from splitserve.sampling_params import sibling_seed

PARTS_AT_ONCE = 32   # a request's parts in flight at once (each holds a worker connection)
_EVENT_END = b"\n\n"


class Part(NamedTuple):
    body: dict
    index: int          # its choice's index in the merged answer
    first_choice: bool  # choice 0 of its prompt: its prompt tokens count in usage


def parts(raw: bytes, body: dict, chat: bool) -> list[Part] | None:
    """The request as single-prompt, n = 1 requests; None: it is one already. A request to
    split is first decoded as a worker decodes it, so a bad field is a 400 before any of
    its parts reaches a worker (and n and the batch are bounded as there)."""
    n = body.get("n")
    prompts = None if chat else _batch(body.get("prompt"))
    if not (isinstance(n, int) and n > 1) and prompts is None:
        return None
    req = decode_chat_request(raw) if chat else decode_completion_request(raw)
    n, seed = req.sampling_params().n, body.get("seed")
    out = []
    for p, prompt in enumerate(prompts if prompts is not None else [None]):
        for j in range(n):
            one = {**body, "n": 1}
            if prompt is not None:
                one["prompt"] = prompt
            if seed is not None:
                one["seed"] = sibling_seed(seed, j)
            out.append(Part(one, p * n + j, j == 0))
    return out


def _batch(prompt) -> list | None:
    """A completions prompt of several prompts (texts or token-id lists), else None."""
    if isinstance(prompt, list) and len(prompt) > 1 and all(
            isinstance(p, (str, list)) for p in prompt):
        return prompt
    return None


# (the answer, the route it took) of one part
ServeOne = Callable[[object, dict], Awaitable[tuple["Response | ChunkedStream", str]]]


class Fanout:
    """One client request served as its parts: serve_one(request, body) serves one part as
    a whole request (the orchestrator's plan and Pools.serve), writing a stream to what
    `request.stream()` gives it."""

    def __init__(self, request, body: dict, serve_one: ServeOne):
        self.request, self.body, self.serve_one = request, body, serve_one
        self.streaming = body.get("stream") is True
        self.out: ChunkedStream | None = None      # the client's stream, once opened
        self.head: dict = {}                       # id, created, model of the merged answer
        self.usage: list[tuple[Part, dict]] = []

    async def run(self, all_parts: list[Part]) -> Response | ChunkedStream:
        """The merged answer; the first part that fails fails the request (the rest are
        cancelled) unless the client's stream has started: then its error is an event."""
        gate = asyncio.Semaphore(PARTS_AT_ONCE)

        async def one(part: Part):
            async with gate:
                return await self._serve(part)
        tasks = [asyncio.ensure_future(one(p)) for p in all_parts]
        try:
            answers = await asyncio.gather(*tasks)
        except _Failed as failed:
            if self.out is None:
                return failed.response
            await self.out.write(sse_error(failed.message) + DONE)
            return self.out
        finally:
            for t in tasks:
                t.cancel()
        if not self.streaming:
            return Response(orjson.dumps(merge(list(zip(all_parts, answers)))))
        if self.out is None:            # (no part sent an event: every one ended at once)
            self.out = self.request.stream({"Content-Type": SSE, "Cache-Control": "no-cache"})
        if (self.body.get("stream_options") or {}).get("include_usage"):
            chunk = {**self.head, "choices": [], "usage": summed_usage(self.usage)}
            await self.out.write(b"data: " + orjson.dumps(chunk) + _EVENT_END)
        await self.out.write(DONE)
        return self.out

    async def _serve(self, part: Part) -> dict | None:
        sink = _PartRequest(self, part)
        try:
            resp, _ = await self.serve_one(sink, part.body)
        except UpstreamError as exc:
            raise _Failed(_error_response(exc.status, str(exc)), str(exc)) from None
        if isinstance(resp, _PartStream):
            return None
        if resp.status != 200:
            raise _Failed(resp, _message(resp.body))
        if self.streaming:          # a whole SSE body (the context worker ended it)
            await _PartStream(self, part).write(resp.body)
            return None
        return orjson.loads(resp.body)

    async def emit(self, event: dict, part: Part) -> None:
        """A part's event, as the merged stream's."""
        if self.out is None:
            self.out = self.request.stream({"Content-Type": SSE, "Cache-Control": "no-cache"})
        if not self.head:
            self.head = {k: event[k] for k in ("id", "object", "created", "model") if k in event}
        if event.get("usage") is not None and not event.get("choices"):
            self.usage.append((part, event["usage"]))
            return
        choices = [{**c, "index": part.index} for c in event.get("choices") or ()]
        await self.out.write(b"data: " + orjson.dumps(
            {**event, **self.head, "choices": choices}) + _EVENT_END)


class _Failed(Exception):
    def __init__(self, response: Response, message: str):
        super().__init__(message)
        self.response, self.message = response, message


class _PartRequest:
    """The client's request as one part sees it: its own stream() (events rewritten into
    the merged stream), everything else the client's (path, headers, X-Request-Id)."""

    def __init__(self, fanout: Fanout, part: Part):
        self._fanout, self._part = fanout, part

    def stream(self, headers: dict, status: int = 200) -> _PartStream:
        if status != 200:
            raise _Failed(_error_response(status, "a worker answered a part of this request "
                                                  f"with {status}"), f"status {status}")
        return _PartStream(self._fanout, self._part)

    def __getattr__(self, name: str):
        return getattr(self._fanout.request, name)


class _PartStream:
    """What one part's worker streams: whole events go to the merged stream as they come;
    its [DONE] is dropped (the merged stream ends once, after every part)."""

    def __init__(self, fanout: Fanout, part: Part):
        self.fanout, self.part, self.buf = fanout, part, b""

    async def write(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(_EVENT_END)) >= 0:
            event, self.buf = self.buf[:end], self.buf[end + 2:]
            for line in event.split(b"\n"):
                if line.startswith(b"data: ") and line != DONE.strip():
                    await self.fanout.emit(_event(line[6:]), self.part)

    def end(self) -> None:
        pass


def _event(data: bytes) -> dict:
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise _Failed(_error_response(502, "a worker sent an event that is not JSON"),
                      "a worker sent an event that is not JSON") from None
    if not isinstance(event, dict):
        raise _Failed(_error_response(502, "a worker sent an event that is not an object"),
                      "a worker sent an event that is not an object")
    if "error" in event:
        raise _Failed(_error_response(502, _message(orjson.dumps(event))), _message(
            orjson.dumps(event)))
    return event


def merge(answered: list[tuple[Part, dict]]) -> dict:
    """The parts' whole answers as one, in choice order."""
    first = answered[0][1]
    choices = [{**c, "index": part.index} for part, answer in answered
               for c in answer.get("choices") or ()]
    usage = summed_usage([(part, answer.get("usage") or {}) for part, answer in answered])
    return {**first, "choices": choices, "usage": usage}


def summed_usage(usages: list[tuple[Part, dict]]) -> dict:
    """Completion tokens of every part; prompt (and cached) tokens of each prompt once."""
    prompt = sum(u.get("prompt_tokens", 0) for p, u in usages if p.first_choice)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                 for p, u in usages if p.first_choice)
    completion = sum(u.get("completion_tokens", 0) for _, u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _message(raw: bytes) -> str:
    try:
        return str(orjson.loads(raw)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return "a part of this request failed"


def _error_response(status: int, message: str) -> Response:
    return Response(error_body(message, "server_error"), status)
