"""Structured output in the engine: grammars compiled off the step loop, one matcher per
sequence, and the token mask the sampler applies.

`GrammarRoom` owns the requests whose grammar is still compiling: add_request hands it such
a request, a compile thread builds the grammar (grammar_compile.GrammarCompiler, cached by
spec), and each step admits the ones whose grammar is ready. A request whose grammar is
cached is admitted at once. The step loop never compiles.

A sequence's matcher is advanced by every token appended to it (EngineCore._on_token), the
resumed tokens of a migration and a GEN's first_gen_tokens included: the grammar state is a
function of the output tokens alone, never of the prompt's values, so a split request's GEN
resumes it from the tokens the CTX relayed."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import torch
from torch import Tensor

from splitserve.errors import InvalidRequestError
from splitserve.grammar_compile import GrammarCompiler, fill_mask, mask_words
from splitserve.protocol.engine import EngineRequest

logger = logging.getLogger(__name__)

Matcher = llguidance.LLMatcher


class GrammarRoom:
    """Requests waiting for their grammar, in arrival order, by request id."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._waiting: dict[str, tuple[EngineRequest, object, Future]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def submit(self, request: EngineRequest, context: object) -> None:
        """Compile request's grammar in the background; `context` comes back with it."""
        future = self._pool.submit(self.compiler.compile, request.params.grammar)
        self._waiting[request.request_id] = (request, context, future)

    def abort(self, request_id: str) -> bool:
        return self._waiting.pop(request_id, None) is not None

    def ready(self) -> list[tuple[EngineRequest, object, Matcher | None, str | None]]:
        """The waiting requests whose compile ended: (request, context, matcher, None) or
        (request, context, None, error message)."""
        done = [rid for rid, (_, _, f) in self._waiting.items() if f.done()]
        out = []
        for rid in done:
            request, context, future = self._waiting.pop(rid)
            try:
                out.append((request, context, future.result(), None))
            except InvalidRequestError as exc:
                out.append((request, context, None, exc.message))
            except Exception as exc:   # a compiler bug ends this request only
                logger.exception("engine: compiling the grammar of %s failed", rid)
                out.append((request, context, None, f"grammar compilation failed: {exc}"))
        return out

    def cached(self, request: EngineRequest) -> Matcher | None:
        """The compiled grammar if it is in the cache (compile() then only looks it up)."""
        return self.compiler.cached(request.params.grammar)


def start_matcher(template: Matcher, output_tokens: list[int]) -> Matcher:
    """A sequence's own matcher, advanced over the output it already has (a migration's
    resumed tokens)."""
    m = template.deep_copy()
    for token in output_tokens:
        m.consume_token(token)
    return m


class GrammarFailed(Exception):
    """A matcher met one of its per-step limits (grammar_compile._LIMITS) mid-answer."""


def advance(matcher: Matcher, token: int) -> bool:
    """Feeds a sampled token; True when the grammar is complete (nothing may follow but
    the end), so the sequence ends with `stop`. GrammarFailed if the matcher broke down."""
    matcher.consume_token(token)
    if matcher.is_error():
        raise GrammarFailed(f"the grammar cannot go on: {matcher.get_error()[:300]}")
    return matcher.is_stopped()


def allowed_tokens(matchers: list[Matcher], vocab_size: int, device) -> Tensor:
    """(G, V) bool: the tokens each matcher allows next. Bit t of word t // 32 is token t,
    so on a little-endian host the words' bytes unpack, low bit first, in token order."""
    words = np.zeros((len(matchers), mask_words(vocab_size)), dtype=np.int32)   # (G, W)
    for row, m in zip(words, matchers):
        fill_mask(m, row)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")       # (G, 32 W)
    allowed = torch.from_numpy(bits[:, :vocab_size]).view(torch.bool)           # (G, V)
    return allowed.to(device)
