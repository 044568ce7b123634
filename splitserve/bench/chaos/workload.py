"""A chaos campaign's requests and what became of each.

Every request's answer is a function of its body alone (greedy, or seeded sampling, which
is a pure function of seed and position), so a clean run gives the text each must end
with. A request ends one of four ways (`Outcome.kind`): `text` (its choices' texts),
`error` (an HTTP error status with an OpenAI error body, or an SSE error event followed by
`[DONE]`: a clear error), `cut` (the client hung up on purpose), or `broken` (anything else:
a dropped connection, a stream without `[DONE]`, a body that is not an answer, the
deadline passed)."""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from dataclasses import dataclass, field

WORDS = ("alpha", "river", "stone", "copper", "lantern", "meadow", "signal", "harbor",
         "violet", "engine", "summit", "thread")


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def request_pool(seed: int, size: int = 16) -> list[dict]:
    """`size` request bodies drawn from the seed: greedy and seeded, streamed and whole,
    long and short prompts, n of 1 or 2, chat and completions; half share a long prefix,
    so they hit the prefix cache."""
    rng = random.Random(f"pool:{seed}")
    shared = _text(rng, 300)
    pool = []
    for i in range(size):
        prompt = (shared + " " if i % 2 else "") + _text(rng, rng.choice((4, 40, 200)))
        body = {"max_tokens": rng.choice((4, 16, 48, 120)), "stream": rng.random() < 0.5,
                "ignore_eos": True, "n": rng.choice((1, 1, 1, 2))}
        if rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body |= {"temperature": 0.9, "seed": rng.randrange(1 << 30)}
        if rng.random() < 0.3:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        pool.append(body)
    return pool


def path_of(body: dict) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


@dataclass
class Outcome:
    kind: str                         # text | error | cut | broken
    texts: list[str] = field(default_factory=list)
    detail: str = ""
    started: float = 0.0
    ended: float = 0.0


def _choice_text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"] or ""
    part = choice.get("message") or choice.get("delta") or {}
    return part.get("content") or ""


def _whole(status: int, data: bytes) -> Outcome:
    try:
        doc = json.loads(data)
    except ValueError:
        return Outcome("broken", detail=f"HTTP {status}: a body that is not JSON")
    if status >= 400:
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict) \
                and doc["error"].get("message"):
            return Outcome("error", detail=f"HTTP {status}: {doc['error']['message']}")
        return Outcome("broken", detail=f"HTTP {status} without an OpenAI error body")
    choices = sorted(doc.get("choices", []), key=lambda c: c["index"])
    return Outcome("text", [_choice_text(c) for c in choices])


def _streamed(resp: http.client.HTTPResponse) -> Outcome:
    texts: dict[int, str] = {}
    error = None
    while line := resp.readline():
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            if error is not None:
                return Outcome("error", detail=error)
            return Outcome("text", [texts[i] for i in sorted(texts)])
        event = json.loads(data)
        if "error" in event:
            error = event["error"].get("message", "") or "an error event without a message"
            continue
        for c in event.get("choices", []):
            texts[c["index"]] = texts.get(c["index"], "") + _choice_text(c)
    return Outcome("broken", detail="the stream ended without [DONE]"
                   + (f" after an error event ({error})" if error else ""))


class Call:
    """One request on its own connection, in a thread; cut() hangs up at any point."""

    def __init__(self, port: int, body: dict, deadline: float):
        self.port, self.body, self.deadline = port, body, deadline
        self.conn: http.client.HTTPConnection | None = None
        self.was_cut = False
        self.outcome: Outcome | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def cut(self) -> None:
        self.was_cut = True
        conn = self.conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def join(self) -> Outcome:
        self.thread.join(self.deadline + 5)
        return self.outcome or Outcome("broken", detail=f"no end within {self.deadline:g} s")

    def _run(self) -> None:
        started = time.monotonic()
        try:
            out = self._exchange()
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as exc:
            out = Outcome("broken", detail=f"{type(exc).__name__}: {exc}")
        if self.was_cut:
            out = Outcome("cut", detail=out.detail)
        elif time.monotonic() - started > self.deadline:
            out = Outcome("broken", detail=f"ended after its {self.deadline:g} s deadline")
        out.started, out.ended = started, time.monotonic()
        self.outcome = out

    def _exchange(self) -> Outcome:
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.deadline)
        try:
            self.conn.request("POST", path_of(self.body), json.dumps(self.body),
                              {"Content-Type": "application/json"})
            resp = self.conn.getresponse()
            if self.body.get("stream") and resp.status == 200:
                return _streamed(resp)
            return _whole(resp.status, resp.read())
        finally:
            self.conn.close()
