"""What `splitserve bench serve` sends (workloads), and when (`Load`: closed or open loop).

A workload is an endless iterator of `Session`s; a session is a list of `Turn`s sent one after
another (a chat conversation), and every turn is one request. Single-turn workloads yield
one-turn sessions. Prompts are built for the endpoint: token-id lists for /v1/completions
(exact input lengths), random text from a fixed word list for /v1/chat/completions (about one
token per word with BPE tokenizers; the server's `usage.prompt_tokens` is what gets reported).

- random:        prompts of --input-len tokens (uniform in len*(1±range_ratio) when r > 0)
- shared-prefix: --num-prefix-groups groups, each a common --prefix-len prefix + random suffix
- multi-turn:    chats of --turns turns; each turn appends the previous answer (chat only)
- mixed:         short chats, and with probability --long-fraction a long prompt of
                 --long-len-min..--long-len-max tokens; turns are tagged "short" / "long"
- swing:         --input-len / --output-len for --swing-period seconds, then the two swapped,
                 and so on (10:1 <-> 1:10): what a planner moving workers between the pools
                 is for; turns are tagged "input-heavy" / "output-heavy"
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterator

import numpy as np

from splitserve.bench.metrics import RequestRecord

WORKLOADS = ("random", "shared-prefix", "multi-turn", "mixed", "swing")
CHAT_ONLY = ("multi-turn",)

# Token ids drawn for completions prompts: above the special tokens every common tokenizer
# keeps at the low end, below the smallest vocabulary (32k) we expect to benchmark.
TOKEN_ID_RANGE = (1000, 30000)
# Extra seed words keep the shared-prefix and arrival generators apart from the main one.
_PREFIX_STREAM, _ARRIVAL_STREAM = 0x5EED, 0xA441

_WORDS = """time year people way day man thing woman life child world school state family
student group country problem hand part place case week company system program question work
government number night point home water room mother area money story fact month lot right
study book eye job word business issue side kind head house service friend father power hour
game line end member law car city community name president team minute idea kid body
information back parent face others level office door health person art war history party
result change morning reason research girl guy moment air teacher force education foot boy age
policy process music market sense nation plan college interest death experience effect use
class control care field development role effort rate heart drug show leader light voice wife
police mind price report decision son view relationship town road arm difference value
building action model season society tax director position player record paper space ground
form event official matter center couple site project activity star table need court oil
situation cost industry figure street image phone data picture practice piece land product
doctor wall patient worker news test movie north love support technology step baby computer
type attention film tree source organization hair window evidence population river""".split()


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str = "random"
    endpoint: str = "completions"          # "completions" (token ids) or "chat" (text)
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    num_prefix_groups: int = 4
    prefix_len: int = 512
    turns: int = 3
    long_fraction: float = 0.1
    long_len_min: int = 2000
    long_len_max: int = 6000
    swing_period: float = 120.0            # swing: seconds each shape lasts
    response_format: str = "text"          # text, json_object or json_schema (RESPONSE_FORMATS)
    # Fresh by default: a rerun against the same server must not find its prompts in the
    # prefix cache. The seed is recorded with the results; pass it to repeat a run exactly.
    seed: int = field(default_factory=lambda: int.from_bytes(os.urandom(4), "little"))

    def __post_init__(self):
        if self.kind not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.kind!r}")
        if self.response_format not in RESPONSE_FORMATS:
            raise ValueError(f"response_format must be one of {list(RESPONSE_FORMATS)}, got "
                             f"{self.response_format!r}")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be completions or chat, got {self.endpoint!r}")
        if self.kind in CHAT_ONLY and self.endpoint != "chat":
            raise ValueError(f"the {self.kind} workload needs --endpoint chat")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--input-len and --output-len must be at least 1")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.num_prefix_groups < 1 or self.prefix_len < 0 or self.turns < 1:
            raise ValueError("--num-prefix-groups and --turns must be >= 1, --prefix-len >= 0")
        if not self.swing_period > 0:
            raise ValueError(f"--swing-period must be positive, got {self.swing_period}")
        if not 0 <= self.long_fraction <= 1 or not 1 <= self.long_len_min <= self.long_len_max:
            raise ValueError("need 0 <= --long-fraction <= 1 and "
                             "1 <= --long-len-min <= --long-len-max")


@dataclass(frozen=True)
class Turn:
    prompt: list[int] | str     # token ids (completions) or the user message text (chat)
    input_len: int              # tokens asked for (the server's count may differ for text)
    output_len: int
    cls: str = "default"


@dataclass(frozen=True)
class Session:
    turns: list[Turn]
    conversation: int = 0


# Structured output's load: a schema whose one free string runs until max_tokens as often as
# unconstrained text does, so the two compare at the same output lengths.
RESPONSE_FORMATS = {
    "text": None,
    "json_object": {"type": "json_object"},
    "json_schema": {"type": "json_schema", "json_schema": {"name": "answer", "strict": True,
                    "schema": {"type": "object", "properties": {"answer": {"type": "string"}},
                               "required": ["answer"], "additionalProperties": False}}},
}


def request_body(turn: Turn, history: list[dict], model: str, chat: bool, stream: bool,
                 response_format: str = "text") -> dict:
    """The OpenAI request for one turn. ignore_eos + max_tokens make output lengths exact on
    servers that know ignore_eos (others ignore the extra field; a grammar that completes
    ends its answer early); greedy, like vLLM's bench."""
    body = {"model": model, "max_tokens": turn.output_len, "ignore_eos": True,
            "temperature": 0.0, "stream": stream}
    if RESPONSE_FORMATS[response_format] is not None:
        body["response_format"] = RESPONSE_FORMATS[response_format]
    if chat:
        body["messages"] = [*history, {"role": "user", "content": turn.prompt}]
    else:
        body["prompt"] = turn.prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def add_arguments(p) -> None:
    p.add_argument("--workload", default="random", choices=WORKLOADS)
    p.add_argument("--input-len", type=int, default=128,
                   help="prompt tokens (the suffix for shared-prefix)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens, exact with ignore_eos")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in len*(1-r)..len*(1+r)")
    p.add_argument("--num-prefix-groups", type=int, default=4, help="shared-prefix")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix")
    p.add_argument("--turns", type=int, default=3, help="multi-turn")
    p.add_argument("--long-fraction", type=float, default=0.1, help="mixed: share of long prompts")
    p.add_argument("--long-len-min", type=int, default=2000, help="mixed")
    p.add_argument("--long-len-max", type=int, default=6000, help="mixed")
    p.add_argument("--swing-period", type=float, default=120.0,
                   help="swing: seconds of --input-len/--output-len requests, then as many of "
                        "the two swapped, and again (e.g. 10:1 <-> 1:10)")
    p.add_argument("--response-format", choices=list(RESPONSE_FORMATS), default="text",
                   help="structured output for every request: json_schema is one free string")
    p.add_argument("--seed", type=int, default=None,
                   help="prompts and arrivals (default: fresh each run, recorded in the JSON)")


def config_from_args(args) -> WorkloadConfig:
    chat_first = args.workload in ("multi-turn", "mixed")
    endpoint = args.endpoint or ("chat" if chat_first else "completions")
    return WorkloadConfig(
        kind=args.workload, endpoint=endpoint, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, num_prefix_groups=args.num_prefix_groups,
        prefix_len=args.prefix_len, turns=args.turns, long_fraction=args.long_fraction,
        long_len_min=args.long_len_min, long_len_max=args.long_len_max,
        swing_period=args.swing_period, response_format=args.response_format,
        **({} if args.seed is None else {"seed": args.seed}))


def sessions(cfg: WorkloadConfig, clock=time.monotonic) -> Iterator[Session]:
    """The workload's endless session stream, deterministic in cfg.seed (swing: and in when
    each session is taken, by `clock`)."""
    rng = np.random.default_rng(cfg.seed)
    make = {"random": _random, "shared-prefix": _shared_prefix, "multi-turn": _multi_turn,
            "mixed": _mixed, "swing": _swing(clock)}[cfg.kind]
    conversation = 0
    while True:
        yield Session(make(cfg, rng, conversation), conversation)
        conversation += 1


def _length(rng, n: int, ratio: float) -> int:
    if ratio == 0:
        return n
    return int(rng.integers(max(1, int(n * (1 - ratio))), int(n * (1 + ratio)) + 1))


def _prompt(cfg: WorkloadConfig, rng, n: int) -> list[int] | str:
    if cfg.endpoint == "completions":
        return rng.integers(*TOKEN_ID_RANGE, n).tolist()
    return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), n))


def _turn(cfg: WorkloadConfig, rng, input_len: int, cls: str = "default") -> Turn:
    return Turn(_prompt(cfg, rng, input_len), input_len,
                _length(rng, cfg.output_len, cfg.range_ratio), cls)


def _random(cfg: WorkloadConfig, rng, conversation: int) -> list[Turn]:
    return [_turn(cfg, rng, _length(rng, cfg.input_len, cfg.range_ratio))]


def _shared_prefix(cfg: WorkloadConfig, rng, conversation: int) -> list[Turn]:
    # Each group's prefix comes from its own generator, so it is identical on every use.
    group = conversation % cfg.num_prefix_groups
    prefix = _prompt(cfg, np.random.default_rng([cfg.seed, _PREFIX_STREAM, group]), cfg.prefix_len)
    suffix_len = _length(rng, cfg.input_len, cfg.range_ratio)
    suffix = _prompt(cfg, rng, suffix_len)
    prompt = prefix + suffix if isinstance(prefix, list) else f"{prefix} {suffix}".strip()
    return [Turn(prompt, cfg.prefix_len + suffix_len,
                 _length(rng, cfg.output_len, cfg.range_ratio))]


def _multi_turn(cfg: WorkloadConfig, rng, conversation: int) -> list[Turn]:
    return [_turn(cfg, rng, _length(rng, cfg.input_len, cfg.range_ratio))
            for _ in range(cfg.turns)]


def _mixed(cfg: WorkloadConfig, rng, conversation: int) -> list[Turn]:
    if rng.random() < cfg.long_fraction:
        n = int(rng.integers(cfg.long_len_min, cfg.long_len_max + 1))
        return [_turn(cfg, rng, n, "long")]
    return [_turn(cfg, rng, _length(rng, cfg.input_len, cfg.range_ratio), "short")]


def _swing(clock):
    """Requests of --input-len / --output-len for --swing-period seconds from the first one
    taken, then of the two swapped for as long, and so on: a workload whose input:output
    ratio swings (class "input-heavy" or "output-heavy" by which is longer)."""
    start = None

    def make(cfg: WorkloadConfig, rng, conversation: int) -> list[Turn]:
        nonlocal start
        now = clock()
        start = now if start is None else start
        swapped = int((now - start) // cfg.swing_period) % 2 == 1
        isl, osl = (cfg.output_len, cfg.input_len) if swapped else (cfg.input_len, cfg.output_len)
        cls = "input-heavy" if isl > osl else "output-heavy" if osl > isl else "default"
        n = _length(rng, isl, cfg.range_ratio)
        return [Turn(_prompt(cfg, rng, n), n, _length(rng, osl, cfg.range_ratio), cls)]
    return make


# -- load: when turns are sent ----------------------------------------------------------------
class Budget:
    """Which requests may still start: the request count and the deadline, whichever first."""

    def __init__(self, num_requests: int | None, duration: float | None):
        self.left = num_requests
        self.deadline = None if duration is None else time.perf_counter() + duration

    def exhausted(self) -> bool:
        late = self.deadline is not None and time.perf_counter() >= self.deadline
        return self.left == 0 or late

    def take(self) -> bool:
        if self.exhausted():
            return False
        if self.left is not None:
            self.left -= 1
        return True


Send = Callable[[RequestRecord, Turn, list[dict]], Awaitable[str]]   # fills the record; the answer


class Load:
    """Drives sessions through `send` until the budget runs out; keeps one record per turn.
    `duration` runs from construction (just before the first request) to the last answer."""

    def __init__(self, send: Send, budget: Budget):
        self.send, self.budget = send, budget
        self.records: list[RequestRecord] = []
        self.t0 = time.perf_counter()
        self.duration = 0.0

    async def closed_loop(self, stream: Iterator[Session], concurrency: int) -> None:
        async def worker():
            while not self.budget.exhausted():
                await self._session(next(stream))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        self.duration = time.perf_counter() - self.t0

    async def open_loop(self, stream: Iterator[Session], rate: float, burstiness: float,
                        seed: int) -> None:
        rng = np.random.default_rng([seed, _ARRIVAL_STREAM])
        tasks = []
        while not self.budget.exhausted():
            tasks.append(asyncio.create_task(self._session(next(stream))))
            await asyncio.sleep(0)    # the session takes its first request from the budget now
            if not self.budget.exhausted():   # no idle gap after the last arrival
                # gamma(shape=b, scale=1/(r*b)) has mean 1/r; b == 1 is the exponential (Poisson)
                await asyncio.sleep(rng.gamma(burstiness, 1.0 / (rate * burstiness)))
        await asyncio.gather(*tasks)
        self.duration = time.perf_counter() - self.t0

    async def _session(self, session: Session) -> None:
        """A conversation's turns in order; each turn sees the previous answers."""
        history: list[dict] = []
        for i, turn in enumerate(session.turns):
            if not self.budget.take():
                return
            rec = RequestRecord(cls=turn.cls, conversation=session.conversation, turn=i,
                                start=time.perf_counter() - self.t0, input_len=turn.input_len,
                                max_tokens=turn.output_len)
            self.records.append(rec)
            answer = await self.send(rec, turn, history)
            if rec.error is not None:
                return    # a broken conversation does not go on
            history = [*history, {"role": "user", "content": turn.prompt},
                       {"role": "assistant", "content": answer}]

    async def progress(self, total: int | None, every: float = 0.5) -> None:
        """A status line on stderr until cancelled."""
        try:
            while True:
                await asyncio.sleep(every)
                self._print_progress(total)
        finally:
            self._print_progress(total)
            print(file=sys.stderr)

    def _print_progress(self, total: int | None) -> None:
        done = sum(r.error is not None or r.e2e is not None for r in self.records)
        errors = sum(r.error is not None for r in self.records)
        print(f"\r  {done}/{total or '?'} requests  {errors} errors  "
              f"{time.perf_counter() - self.t0:6.1f} s", end="", file=sys.stderr, flush=True)
