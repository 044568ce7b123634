"""How EngineCore turns sampled tokens into CompletionDeltas: the incremental detokenizer
(and the stop strings it matches), the first token's fields, and final-only merging (a
response sent whole gets one delta per sequence). It builds deltas only: whether a token
ends a sequence, and ending it, are the scheduler's (engine/queues.py). Every method runs
on the engine thread.
"""

from __future__ import annotations

import time

from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.engine.request import FinishReason, Request
from splitserve.protocol.engine import CompletionDelta


class OutputBuilder:
    """Owns each sequence's detokenizer and, for a sequence whose response is sent whole
    (stream=False), the delta it holds until it finishes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}   # by id(request)
        # Sequences sent whole: their deltas merge here and leave once, when the sequence
        # finishes, not once per step. None until the first token.
        self.final_only: dict[int, CompletionDelta | None] = {}

    def send_whole(self, req: Request) -> None:
        self.final_only[id(req)] = None

    def forget(self, req: Request) -> None:
        """Drop what is held for a request taken out without finishing."""
        self.final_only.pop(id(req), None)
        self.detokenizers.pop(id(req), None)

    def token_delta(self, req: Request, token: int, logprob) -> tuple[CompletionDelta, str | None]:
        """The delta of req's newly sampled token, built before the scheduler records it
        (so the sequence's first token carries the request's first-token fields), and the
        stop string the detokenizer matched with it. A stop token (EOS, stop_token_ids)
        ends the sequence without text: it is not detokenized."""
        delta = CompletionDelta(req.group_id, req.index, [token], "",
                                logprobs=None if logprob is None else [logprob])
        if req.num_output_tokens == req.num_resumed_tokens:
            self._first_token_fields(req, delta)
        stop = None
        if not req.is_stop_token(token):
            delta.text, stop = self.detokenizer(req).step([token])
        return delta, stop

    def _first_token_fields(self, req: Request, delta: CompletionDelta) -> None:
        delta.prompt_logprobs = req.prompt_logprobs
        delta.num_prompt_tokens = req.num_prompt_tokens
        delta.num_cached_tokens = req.num_cached_tokens
        if req.first_scheduled_time is not None:
            delta.queue_time = req.first_scheduled_time - req.arrival_time
            delta.prefill_time = time.monotonic() - req.first_scheduled_time
        delta.kv_transfer_time = req.kv_transfer_time
        delta.admit_time = req.admit_time
        if req.prompt_back:   # its values came with the KV: the front-end echoes them
            delta.prompt_bytes = req.prompt.tobytes()
        if id(req) in self.final_only:
            delta.first_token_time = time.time()   # its TTFT: no delta leaves now

    def emit(self, req: Request, delta: CompletionDelta, out: list[CompletionDelta]) -> None:
        """A delta of a sequence that goes on: out now, or held if it is sent whole."""
        if id(req) in self.final_only:
            self._hold(req, delta)
        else:
            out.append(delta)

    def _hold(self, req: Request, delta: CompletionDelta) -> CompletionDelta:
        """Merge a final-only sequence's delta into what it holds; returns the merged one."""
        held = self.final_only[id(req)]
        if held is None:
            self.final_only[id(req)] = delta
            return delta
        held.token_ids += delta.token_ids
        held.text += delta.text
        if delta.logprobs is not None:
            if held.logprobs is None:
                held.logprobs = []
            held.logprobs += delta.logprobs
        return held

    def detokenizer(self, req: Request) -> IncrementalDetokenizer:
        d = self.detokenizers.get(id(req))
        if d is None:
            d = self.detokenizers[id(req)] = IncrementalDetokenizer(self.tokenizer, req.params)
        return d

    def final_delta(self, req: Request, reason: FinishReason, delta: CompletionDelta | None = None,
                    error: str | None = None) -> CompletionDelta:
        """The last delta of req, which ends for `reason` (delta: its last token's, if any):
        what a final-only sequence held merged in, the detokenizer's held-back text flushed
        (unless a stop string cut it). Built before the scheduler ends req, which it does
        not change."""
        if delta is None:
            delta = CompletionDelta(req.group_id, req.index, [], "")
        if id(req) in self.final_only:
            delta = self._hold(req, delta)
            del self.final_only[id(req)]
        detok = self.detokenizers.pop(id(req), None)
        # A matched stop string already cut the text; a handed-off sequence's held-back text
        # is the next worker's to send (its detokenizer reads the same tokens and holds it).
        if detok is not None and not isinstance(req.stop_reason, str) \
                and reason != FinishReason.HANDOFF:
            delta.text += detok.flush()
        delta.finish_reason = int(reason)
        delta.stop_reason = req.stop_reason
        delta.error = error
        return delta
