"""SamplingParams: what a request samples with. A msgspec Struct so the same object is the
offline API's argument and the front-end -> engine wire type; validated on construction."""

from __future__ import annotations

import msgspec

from splitserve.errors import InvalidRequestError
from splitserve.protocol.grammar import GrammarSpec

_MAX_LOGPROBS = 20
# Bounds on what a client may ask for. Counts and token ids are int32 everywhere below the
# API (prompt arrays, tensors), seeds int64 (vLLM's range; torch's generator takes any of
# them); anything larger would fail far from where it was sent, or take the engine down.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
MAX_N = 128


def sibling_seed(seed: int, i: int) -> int:
    """The seed choice i of an n > 1 request samples with: seed + i, wrapped into int64 like
    a C counter, so a seed at the top of the range does not push its siblings' past what
    msgpack and torch take. A worker's siblings and the orchestrator's split choices
    (orchestrator/split.py) both use it, so a seeded answer is the same either way."""
    return (seed + i + 2**63) % 2**64 - 2**63
MAX_STOP = 16
MAX_STOP_LEN = 256        # characters per stop string: each step searches a window this wide
MAX_TOKEN_ID_LIST = 1024  # entries of logit_bias and of stop_token_ids


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    n: int = 1
    max_tokens: int | None = 16          # None: up to the model's context
    min_tokens: int = 0
    temperature: float = 1.0             # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0      # reads prompt and generated tokens
    frequency_penalty: float = 0.0       # OpenAI: generated tokens only
    presence_penalty: float = 0.0        # OpenAI: generated tokens only
    logit_bias: dict[int, float] | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None          # alternatives per generated token; 0: sampled only
    prompt_logprobs: int | None = None   # alternatives per prompt token; 0: prompt token only
    skip_special_tokens: bool = True
    grammar: GrammarSpec | None = None   # structured output: what the answer must match

    def __post_init__(self):
        _check(1 <= self.n <= MAX_N, f"n must be between 1 and {MAX_N}", "n")
        _check(self.max_tokens is None or 1 <= self.max_tokens <= INT32_MAX,
               f"max_tokens must be between 1 and {INT32_MAX}", "max_tokens")
        _check(0 <= self.min_tokens <= INT32_MAX,
               f"min_tokens must be between 0 and {INT32_MAX}", "min_tokens")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               "min_tokens must not exceed max_tokens", "min_tokens")
        _check(0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]", "temperature")
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p")
        _check(-1 <= self.top_k <= INT32_MAX,
               f"top_k must be -1 or 0 (off), or at most {INT32_MAX}", "top_k")
        _check(self.seed is None or INT64_MIN <= self.seed <= INT64_MAX,
               f"seed must be between {INT64_MIN} and {INT64_MAX}", "seed")
        _check(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", "min_p")
        _check(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]",
               "repetition_penalty")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]",
               "frequency_penalty")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]",
               "presence_penalty")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or 0 <= value <= _MAX_LOGPROBS,
                   f"{name} must be between 0 and {_MAX_LOGPROBS}", name)
        if self.logit_bias:
            _check_token_ids(self.logit_bias, "logit_bias")
            for tok, bias in self.logit_bias.items():
                _check(-100.0 <= bias <= 100.0, f"logit_bias for token {tok} must be in [-100, 100]",
                       "logit_bias")
        _check_token_ids(self.stop_token_ids, "stop_token_ids")
        _check(len(self.stop) <= MAX_STOP, f"at most {MAX_STOP} stop strings are supported", "stop")
        _check(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_LEN for s in self.stop),
               f"stop strings must be 1 to {MAX_STOP_LEN} characters long", "stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_token_counts(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the caller named must exist; checked where the vocabulary is known."""
        if not (self.logit_bias or self.stop_token_ids):
            return
        for name, ids in (("logit_bias", self.logit_bias or ()), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if not 0 <= int(t) < vocab_size]
            _check(not bad, f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                   name)


def _check_token_ids(ids, name: str) -> None:
    """Size and int32 range only: whether they are in the vocabulary is check_vocab's job."""
    if not ids:
        return
    _check(len(ids) <= MAX_TOKEN_ID_LIST, f"{name} may name at most {MAX_TOKEN_ID_LIST} tokens",
           name)
    _check(0 <= min(ids) and max(ids) <= INT32_MAX, f"{name} must hold token ids (0 to "
           f"{INT32_MAX})", name)


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param)
