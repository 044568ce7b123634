"""Compiling a GrammarSpec (protocol/grammar.py) for one tokenizer with llguidance.

Why llguidance (and not xgrammar): docs/tuning.md#structured-output. Its work is bounded
by fuel, not by a clock: building a grammar's lexer and each token mask stop with an error
past fixed limits (`_LIMITS`), so a pathological regex or schema is an error in
milliseconds, never a stuck thread.

`GrammarCompiler.compile` gives a matcher at the grammar's start, cached by the spec's key
(an LRU of `cache_size`); each sequence takes its own `deep_copy()` (cheap). The front-end
compiles every grammar once before the request is admitted (a bad one is a 400 naming the
field: `check`); the engine compiles again in its own process, off its step loop. Neither
imports torch: masks are int32 bitmaps, bit t of word t // 32 set when token t is allowed."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance
import numpy as np

from splitserve.errors import InvalidRequestError
from splitserve.protocol.grammar import CHOICE, JSON, LARK, REGEX, GrammarSpec

# Well inside llguidance's defaults; fuel is its unit of work (~50k/ms building the lexer,
# ~14k/ms per mask), so a grammar that needs more is refused in about 10 ms.
_LIMITS = dict(initial_lexer_fuel=500_000, step_lexer_fuel=200_000, step_max_items=50_000,
               max_lexer_states=100_000, max_grammar_size=200_000)

# JSON answers are written in one fixed style, `{"a": 1, "b": [2, 3]}`, as vLLM's
# --structured-outputs-config.disable_any_whitespace does: free whitespace lets a small
# model pad an answer with newlines until max_tokens. A schema's "x-guidance" may change it.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for a spec (its compiler parses it when a matcher is built)."""
    if spec.kind == JSON:
        return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=_JSON_STYLE)
    if spec.kind == REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == CHOICE:   # JSON string literals are Lark string literals
        choices = " | ".join(json.dumps(c) for c in json.loads(spec.source))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {choices}")
    assert spec.kind == LARK, spec.kind
    source = spec.source
    if "::=" in source:        # GBNF (llama.cpp's, xgrammar's EBNF): llguidance converts it
        source = llguidance.gbnf_to_lark.gbnf_to_lark(source)
    return llguidance.LLMatcher.grammar_from_lark(source)


class GrammarCompiler:
    """Compiled grammars of one vocabulary. Thread-safe: compile() may run in several pool
    threads; the tokenizer is built on first use (~0.4 s for a 49k vocabulary)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = 256):
        self.vocab_size = vocab_size
        self._args = (tokenizer_json, vocab_size, list(eos_token_ids))
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def _llt(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                text, n_vocab, eos = self._args
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=eos)
            return self._tokenizer

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A matcher at the start of spec's grammar (shared: deep_copy it before use).
        InvalidRequestError naming spec.field when the grammar is invalid, too costly, or
        allows no first token (a schema no value satisfies)."""
        hit = self.cached(spec)
        if hit is not None:
            return hit
        matcher = self._build(spec)
        with self._lock:
            self._cache[spec.key] = matcher
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher

    def cached(self, spec: GrammarSpec) -> llguidance.LLMatcher | None:
        """spec's compiled matcher if the cache holds it, else None (never compiles)."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
            return hit

    def _build(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        try:
            text = grammar_text(spec)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise InvalidRequestError(f"{spec.field} is not a valid grammar: "
                                      f"{str(exc)[:300]}", spec.field) from None
        limits = llguidance.LLParserLimits(**_LIMITS, verbose_errors=False)
        matcher = llguidance.LLMatcher(self._llt(), text, log_level=0, limits=limits)
        mask = np.zeros(mask_words(self.vocab_size), dtype=np.int32)
        if not matcher.is_error():   # the first mask: where lazy lexers meet their limits
            fill_mask(matcher, mask)
        if matcher.is_error():
            raise InvalidRequestError(f"{spec.field} cannot be used: "
                                      f"{matcher.get_error()[:300]}", spec.field)
        if not mask.any():
            raise InvalidRequestError(f"{spec.field} allows no output at all", spec.field)
        return matcher

    def check(self, spec: GrammarSpec | None) -> None:
        """The front-end's check: raises what compile() raises; nothing for no grammar."""
        if spec is not None:
            self.compile(spec)


def fill_mask(matcher: llguidance.LLMatcher, row: np.ndarray) -> None:
    """The matcher's allowed next tokens into `row`, a C-contiguous int32 array of
    mask_words(vocab) words (a view into a larger buffer is fine)."""
    matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
