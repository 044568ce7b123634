"""IncrementalDetokenizer: generated token ids -> text deltas that are safe to stream.

Two things make streaming text harder than decoding at the end:

1. A byte-level BPE token can carry part of a multi-byte UTF-8 character; it decodes to
   "\\ufffd" until a later token completes it. We decode a short window of tokens
   [prefix_offset, end) and emit only what it adds over [prefix_offset, read_offset), and
   only once it no longer ends in "\\ufffd" (vLLM's prefix/read offset technique). The
   window starts at the previous emission, so each step costs O(1) in the output length.
2. Stop strings can straddle steps. Each step searches only the new text plus the last
   (longest stop - 1) characters, and holds back the longest suffix that could still grow
   into a stop string, so a streamed delta never has to be retracted.

Stop token ids are not handled here: the engine stops on those by id and never feeds them.
"""

from __future__ import annotations

from typing import Protocol

from splitserve.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    """One per generated sequence; owned by whoever turns engine outputs into text."""

    def __init__(self, tokenizer: Decoder, params: SamplingParams):
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._lookback = max((len(s) for s in self._stops), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0      # window start: where the last emitted decode began
        self._read_offset = 0        # tokens before this are already turned into text
        self._tail = ""              # last `lookback` chars of all decoded text, to search
        self._pending = ""           # decoded but held back (a suffix of _tail)
        self._chunks: list[str] = []
        self.stop_str: str | None = None   # the stop string that ended the text, if any

    @property
    def finished(self) -> bool:
        return self.stop_str is not None

    @property
    def text(self) -> str:
        """All emitted text; after a stop or flush(), the final output text."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def step(self, new_token_ids: list[int]) -> tuple[str, str | None]:
        """Feed generated tokens -> (delta safe to emit now, stop string matched or None).
        After a stop string matched, further tokens are ignored and yield ("", None)."""
        if self.finished:
            return "", None
        self._ids.extend(new_token_ids)
        return self._emit(self._decode_new(final=False))

    def flush(self) -> str:
        """The request ended for another reason (length, eos): release held-back text and
        any trailing partial character, still cut at a stop string if one completes."""
        if self.finished:
            return ""
        delta, _ = self._emit(self._decode_new(final=True), final=True)
        return delta

    # -- decoding -----------------------------------------------------------------------
    def _decode_new(self, final: bool) -> str:
        """Text that tokens past read_offset add; "" while they end mid-character."""
        ids, start, read = self._ids, self._prefix_offset, self._read_offset
        if read == len(ids):
            return ""
        prefix_text = self._decode(ids[start:read]) if read > start else ""
        new_text = self._decode(ids[start:])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT)):
            return ""
        self._prefix_offset, self._read_offset = read, len(ids)
        return new_text[len(prefix_text):]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    # -- stop strings -------------------------------------------------------------------
    def _emit(self, new_text: str, final: bool = False) -> tuple[str, str | None]:
        if not new_text and not (final and self._pending):
            return "", None
        window = self._tail + new_text          # look-back + new text: all a match can span
        already_out = len(self._tail) - len(self._pending)
        match = self._find_stop(window)
        if match is not None:
            stop, start, end = match
            cut = end if self._include_stop else start
            # Held-back text covers any match start, so nothing emitted is ever cut.
            assert cut >= already_out, "emitted text overlaps a stop string"
            self.stop_str, self._pending = stop, ""
            return self._out(window[already_out:cut]), stop
        keep = 0 if final else self._holdback(window)
        self._pending = window[len(window) - keep:]
        self._tail = window[-self._lookback:] if self._lookback else ""
        return self._out(window[already_out:len(window) - keep]), None

    def _find_stop(self, window: str) -> tuple[str, int, int] | None:
        """The match that completes first (the one a char-by-char stream would hit), so the
        result does not depend on how tokens were grouped into steps. Ties: longest."""
        best = None
        for stop in self._stops:
            i = window.find(stop)
            if i >= 0 and (best is None or (i + len(stop), i) < (best[2], best[1])):
                best = (stop, i, i + len(stop))
        return best

    def _holdback(self, window: str) -> int:
        """Length of the longest suffix of window that is a proper prefix of a stop string.
        With include_stop_str_in_output nothing before a stop's end is ever cut."""
        if self._include_stop:
            return 0
        for n in range(min(self._lookback, len(window)), 0, -1):
            suffix = window[-n:]
            if any(s.startswith(suffix) for s in self._stops):
                return n
        return 0

    def _out(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
        return delta
