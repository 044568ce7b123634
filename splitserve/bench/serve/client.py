"""The HTTP side of `splitserve bench serve`: one request sent, its response read (streamed
or whole) into a RequestRecord, and the server's model name and /metrics."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import msgspec

from splitserve.bench import metrics as M
from splitserve.prometheus import parse_prometheus
from splitserve.bench.serve import workloads
from splitserve.bench.serve.workloads import Turn


class _Text(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None          # completions
    delta: _Text | None = None       # chat, streaming
    message: _Text | None = None     # chat, not streaming


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Body(msgspec.Struct):
    """A response body or one SSE event (unknown fields ignored)."""
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: Any = None

    def content(self) -> str:
        return "".join(c.text or (c.delta or c.message or _Text()).content or ""
                       for c in self.choices)


class _Failure(Exception):
    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


_DECODER = msgspec.json.Decoder(_Body)


def _decode(data: bytes) -> _Body:
    try:
        body = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise _Failure("invalid_response", f"{exc}: {data[:200]!r}") from None
    if body.error is not None:
        raise _Failure("error_event", str(body.error)[:300])
    return body


class ServeClient:
    """Sends one turn and fills its RequestRecord; never raises for a failed request."""

    def __init__(self, http: aiohttp.ClientSession, url: str, endpoint: str, model: str,
                 stream: bool, response_format: str = "text"):
        self.http, self.model, self.stream = http, model, stream
        self.response_format = response_format
        self.chat = endpoint == "chat"
        self.url = url.rstrip("/") + ("/v1/chat/completions" if self.chat else "/v1/completions")

    async def send(self, rec: M.RequestRecord, turn: Turn, history: list[dict]) -> str:
        """The answer's text ("" on failure)."""
        body = workloads.request_body(turn, history, self.model, self.chat, self.stream,
                                      self.response_format)
        data = msgspec.json.encode(body)
        t0 = time.perf_counter()
        try:
            async with self.http.post(self.url, data=data, headers=_JSON) as resp:
                if resp.status != 200:
                    detail = (await resp.read())[:300].decode(errors="replace")
                    raise _Failure(f"http_{resp.status}", detail)
                if self.stream:
                    return await self._read_stream(resp, rec, t0)
                return await self._read_body(resp, rec, t0)
        except _Failure as exc:
            return _fail(rec, exc.kind, str(exc))
        except TimeoutError:           # aiohttp's timeout errors subclass it
            return _fail(rec, "timeout", "no complete response within the timeout")
        except aiohttp.ClientError as exc:
            return _fail(rec, "connection", f"{type(exc).__name__}: {exc}")
        except ValueError as exc:      # e.g. an SSE line longer than the reader's limit
            return _fail(rec, "invalid_response", str(exc))

    async def _read_stream(self, resp, rec: M.RequestRecord, t0: float) -> str:
        if resp.content_type != "text/event-stream":
            raise _Failure("invalid_response", f"content type {resp.content_type!r}, not SSE")
        pieces, last, usage = [], None, None
        async for line in resp.content:                 # one SSE line at a time
            now = time.perf_counter()
            if not line.startswith(b"data:") or rec.e2e is not None:
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                rec.e2e = now - t0                     # read on to EOF so the connection is reused
                continue
            event = _decode(data)
            usage = event.usage or usage
            if text := event.content():
                if last is None:
                    rec.ttft = now - t0
                else:
                    rec.itl.append(now - last)
                last = now
                pieces.append(text)
        if rec.e2e is None:
            raise _Failure("incomplete_stream", f"no [DONE] after {len(pieces)} content chunks")
        if not pieces:
            raise _Failure("empty_response", "the stream carried no content")
        _count_tokens(rec, usage, len(pieces))
        return "".join(pieces)

    async def _read_body(self, resp, rec: M.RequestRecord, t0: float) -> str:
        data = await resp.read()
        rec.e2e = time.perf_counter() - t0
        body = _decode(data)
        text = body.content()
        if (body.usage.completion_tokens if body.usage else len(text)) == 0:
            raise _Failure("empty_response", "the response carried no output token")
        _count_tokens(rec, body.usage, rec.max_tokens)
        return text


_JSON = {"Content-Type": "application/json"}


def _count_tokens(rec: M.RequestRecord, usage: _Usage | None, counted: int) -> None:
    rec.usage = usage is not None
    rec.prompt_tokens = usage.prompt_tokens if usage else rec.input_len
    rec.output_tokens = usage.completion_tokens if usage else counted


def _fail(rec: M.RequestRecord, kind: str, detail: str) -> str:
    rec.error, rec.detail = kind, detail
    rec.ttft, rec.e2e, rec.itl = None, None, []   # a failed request has no latency
    return ""


async def served_model(http: aiohttp.ClientSession, url: str) -> str:
    try:
        async with http.get(url.rstrip("/") + "/v1/models") as resp:
            resp.raise_for_status()
            return (await resp.json())["data"][0]["id"]
    except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, ValueError) as exc:
        raise RuntimeError(f"could not read the model name from {url}/v1/models ({exc}); "
                           "pass --model") from None


async def scrape_metrics(http: aiohttp.ClientSession, url: str) -> dict | str:
    """parse_prometheus(GET /metrics), or why there is none."""
    try:
        async with http.get(url.rstrip("/") + "/metrics") as resp:
            if resp.status != 200:
                return f"GET /metrics answered {resp.status}"
            return parse_prometheus(await resp.text())
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return f"GET /metrics failed: {exc}"
