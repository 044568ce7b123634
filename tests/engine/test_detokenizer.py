"""IncrementalDetokenizer against a real byte-level BPE tokenizer trained in the fixture."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.sampling_params import SamplingParams

CORPUS = [
    "héllo 😀 日本 world", "the quick brown fox jumps over the lazy dog",
    "naïve café 日本語 テキスト 😀😀 🎉", "hello world, hello there. stop here!",
    "Größe Ωμέγα ünïcödé ✓ ok",
]
ALPHABET = "abcdehlorstw ,.!éï日本語😀🎉✓Ω"
EOS = "<eos>"


class Adapter:
    """What the engine hands the detokenizer: decode(ids, skip_special_tokens) -> str.
    Records each decode's length so tests can check the window stays short."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.window_sizes: list[int] = []

    def decode(self, ids, skip_special_tokens: bool) -> str:
        self.window_sizes.append(len(ids))
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> printable char table that ByteLevel BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return table


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(CORPUS * 3, trainer)
    return t


def byte_ids(tok: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: multi-byte characters split across tokens."""
    table = _byte_to_char()
    return [tok.token_to_id(table[b]) for b in text.encode()]


def run(tok, ids, chunks=None, **params):
    """Feed ids in chunks -> (deltas, stop, flushed, detok)."""
    detok = IncrementalDetokenizer(Adapter(tok), SamplingParams(**params))
    deltas, stop, pos = [], None, 0
    for size in chunks or [1] * len(ids):
        delta, matched = detok.step(ids[pos:pos + size])
        pos += size
        deltas.append(delta)
        assert "".join(deltas) == detok.text        # text is exactly what was emitted
        stop = stop or matched
    if pos < len(ids):
        deltas.append(detok.step(ids[pos:])[0])
    return deltas, stop, detok.flush(), detok


def chunking(draw, n):
    sizes = []
    while sum(sizes) < n:
        sizes.append(draw(st.integers(1, 4)))
    return sizes


@st.composite
def text_and_chunks(draw):
    text = draw(st.text(alphabet=ALPHABET, max_size=40))
    return text, chunking(draw, len(text.encode()))


# -- incremental decoding -------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(data=text_and_chunks(), split_bytes=st.booleans())
def test_deltas_concatenate_to_full_decode(tok, data, split_bytes):
    text, chunks = data
    ids = byte_ids(tok, text) if split_bytes else tok.encode(text).ids
    deltas, stop, flushed, _ = run(tok, ids, chunks)
    assert "".join(deltas) == text and flushed == "" and stop is None
    assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_arbitrary_ids_including_invalid_utf8_match_full_decode(tok, data, skip):
    ids = data.draw(st.lists(st.integers(0, tok.get_vocab_size() - 1), max_size=30))
    deltas, _, flushed, detok = run(tok, ids, skip_special_tokens=skip)
    assert "".join(deltas) + flushed == tok.decode(ids, skip_special_tokens=skip) == detok.text


def test_emoji_split_across_tokens_waits_for_the_whole_character(tok):
    ids = byte_ids(tok, "a😀b")
    deltas, _, flushed, _ = run(tok, ids)
    assert deltas == ["a", "", "", "", "😀", "b"] and flushed == ""


def test_truncated_character_at_the_end_is_flushed_as_the_full_decode_has_it(tok):
    ids = byte_ids(tok, "a😀")[:3]
    deltas, _, flushed, _ = run(tok, ids)
    assert "".join(deltas) == "a"
    assert "".join(deltas) + flushed == tok.decode(ids) and "\ufffd" in flushed


def test_decode_window_stays_short_for_long_outputs(tok):
    ids = tok.encode(" ".join(CORPUS) * 20).ids
    detok = IncrementalDetokenizer(adapter := Adapter(tok), SamplingParams())
    for t in ids:
        detok.step([t])
    assert detok.text == tok.decode(ids) and len(ids) > 500
    assert max(adapter.window_sizes) <= 8        # O(1) per token, not O(output)


def test_skip_special_tokens(tok):
    ids = tok.encode("hello").ids + [tok.token_to_id(EOS)] + tok.encode(" ok").ids
    assert run(tok, ids)[3].text == "hello ok"
    assert run(tok, ids, skip_special_tokens=False)[3].text == "hello<eos> ok"


# -- stop strings ---------------------------------------------------------------------

SENTENCE = "hello world, hello there. stop here!"


def test_stop_string_across_token_boundaries(tok):
    ids = tok.encode(SENTENCE).ids
    assert "o th" not in [tok.decode([i]) for i in ids]          # it really straddles
    deltas, stop, flushed, detok = run(tok, ids, stop=("o th",))
    assert stop == "o th" and flushed == ""
    assert "".join(deltas) == detok.text == "hello world, hell"
    assert detok.step(tok.encode(" more").ids) == ("", None) and detok.text == "hello world, hell"


def test_include_stop_str_in_output(tok):
    deltas, stop, flushed, detok = run(tok, tok.encode(SENTENCE).ids, stop=("o th",),
                                       include_stop_str_in_output=True)
    assert "".join(deltas) == detok.text == "hello world, hello th" and flushed == ""


def test_first_completed_stop_wins(tok):
    ids = tok.encode(SENTENCE).ids
    assert run(tok, ids, stop=("world", "lo w"))[3].text == "hel"
    assert run(tok, ids, [len(ids)], stop=("world", "lo w"))[3].text == "hel"
    assert run(tok, ids, stop=("here!", "e"))[3].text == "h"
    # Found in one step, the stop that starts first but completes later still loses.
    assert run(tok, ids, [len(ids)], stop=("hello world", "lo"))[3].text == "hel"


def test_possible_stop_prefix_is_held_back_then_flushed(tok):
    ids = tok.encode("the lazy dog").ids
    deltas, stop, flushed, detok = run(tok, ids, stop=("dog!",))
    assert "".join(deltas) == "the lazy " and stop is None
    assert flushed == "dog" and detok.text == "the lazy dog" and detok.flush() == ""
    # Text that cannot start a stop string is not delayed at all.
    deltas, _, flushed, _ = run(tok, ids, stop=("zzz",))
    assert "".join(deltas) == "the lazy dog" and flushed == ""


def _reference_stop(text: str, stops: tuple[str, ...], include: bool) -> tuple[str, str | None]:
    """Cut where a char-by-char stream first completes a stop string."""
    for end in range(1, len(text) + 1):
        for s in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(s):
                return text[:end] if include else text[:end - len(s)], s
    return text, None


@settings(max_examples=200, deadline=None)
@given(data=text_and_chunks(), include=st.booleans(),
       stops=st.lists(st.text(alphabet="lo wé😀日", min_size=1, max_size=4), min_size=1,
                      max_size=3))
def test_stops_match_reference_for_any_chunking(tok, data, include, stops):
    text, chunks = data
    stops = tuple(stops)
    detok = IncrementalDetokenizer(Adapter(tok), SamplingParams(
        stop=stops, include_stop_str_in_output=include))
    expected, expected_stop = _reference_stop(text, stops, include)
    ids, pos, stop = byte_ids(tok, text), 0, None
    for size in chunks:
        _, matched = detok.step(ids[pos:pos + size])
        pos += size
        assert expected.startswith(detok.text)      # nothing emitted is ever retracted
        stop = stop or matched
    detok.flush()
    assert (detok.text, stop) == (expected, expected_stop)
