"""The SmolLM2 tokenizer rebuilt from GGUF metadata, and chat-template rendering."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.errors import InvalidRequestError

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def tok(tiny_source):
    # tiny-random carries the bundled GGUF's tokenizer; loading it costs ~0.2 s.
    return tiny_source.tokenizer


def test_special_token_ids(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.id_to_token(0) == "<|endoftext|>"
    assert tok.id_to_token(1) == "<|im_start|>"
    assert tok.id_to_token(2) == "<|im_end|>"
    assert tok.token_to_id("<|im_end|>") == 2
    # The 17 control tokens of the GGUF (ids 0..16) are special; ordinary text is not.
    assert tok.all_special_ids == frozenset(range(17))


def test_bundled_tokenizer_metadata(bundled_source):
    tok = bundled_source.tokenizer
    assert tok.eos_token_ids == (2,)
    assert tok.add_bos is False      # tokenizer.ggml.add_bos_token is false in the GGUF


def test_encode_returns_int32_array(tok):
    ids = tok.encode("Hello world")
    assert isinstance(ids, np.ndarray) and ids.dtype == np.int32 and ids.ndim == 1
    assert tok.decode(ids) == "Hello world"
    assert tok.decode(ids.tolist()) == "Hello world"


@pytest.mark.parametrize("text", [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing tab\t\nand\r\nCRLF\n\n",
    "café naïve Übermaß — “quotes” 日本語のテキスト 한국어 🚀🤖 ∑x²",
    "price: $1,234.56 on 2024-03-01",
])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


# SmolLM2's byte-level vocabulary lacks 21 of the 256 byte tokens: six ASCII control
# characters (e.g. \x06) and bytes that lead rare or invalid UTF-8 (0xF1 leads U+40000..);
# those are dropped, in Hugging Face's tokenizer as here. Text is everything else.
_TEXT = st.one_of(st.characters(max_codepoint=0x3FFFF, exclude_categories=("Cc", "Cs")),
                  st.sampled_from("\n\r\t "))


@settings(max_examples=60, deadline=None)
@given(st.text(_TEXT, max_size=40))
def test_round_trip_any_text(tok, text):
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_digits_are_split_individually(tok):
    ids = tok.encode("12345")
    assert [tok.id_to_token(i) for i in ids] == list("12345")
    assert len(tok.encode("year 2024")) == 1 + 1 + 4   # "year", " ", 2, 0, 2, 4


def test_control_tokens_are_never_split(tok):
    assert tok.encode("<|im_start|>").tolist() == [1]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n").tolist()
    assert ids[0] == 1 and 2 in ids
    assert tok.decode(ids) == "user\nhi\n"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_bos_added_once_only_when_flag_set(tok):
    assert tok.encode("Hi")[0] != 1                          # the GGUF says no BOS
    with_bos = tok.replace(add_bos=True)
    assert with_bos.encode("Hi").tolist() == [1, *tok.encode("Hi").tolist()]
    assert with_bos.encode("<|im_start|>Hi").tolist().count(1) == 1
    assert with_bos.encode("Hi", add_special_tokens=False).tolist() == tok.encode("Hi").tolist()


def test_chat_template_default_system_prompt(tok):
    text = tok.apply_chat_template(FRANCE)
    assert text == (f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
                    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_chat_template_own_system_and_no_generation_prompt(tok):
    messages = [{"role": "system", "content": "Be brief."}, *FRANCE]
    text = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n")


def test_template_raise_exception_is_a_400(tok):
    strict = tok.replace(chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidRequestError, match="roles must alternate") as info:
        strict.apply_chat_template(FRANCE)
    assert info.value.param == "messages"


def test_message_without_content_is_a_400(tok):
    with pytest.raises(InvalidRequestError) as info:
        tok.apply_chat_template([{"role": "user"}])
    assert info.value.param == "messages"


def test_no_template_is_a_400(tok):
    with pytest.raises(InvalidRequestError, match="no chat template") as info:
        tok.replace(chat_template=None).apply_chat_template(FRANCE)
    assert info.value.param == "messages"


def test_template_helpers(tok):
    template = ("{{ tools | tojson }}|{{ strftime_now('%Y') | length }}|{{ bos_token }}"
                "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{{ m.content }}{% endfor %}")
    out = tok.replace(chat_template=template).apply_chat_template(
        FRANCE * 2, tools=[{"name": "<f> é"}])
    # tojson keeps the text as the model should see it: no HTML escaping, no \\u escapes.
    assert out == '[{"name": "<f> é"}]|4|<|im_start|>What is the capital of France?'


def test_template_sandbox_blocks_attribute_escape(tok):
    evil = tok.replace(chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequestError):
        evil.apply_chat_template(FRANCE)


def test_encode_decode_from_threads(tok):
    texts = [f"request {i}: {'lorem ipsum ' * (i % 7)} 日本 {i * 37}" for i in range(64)]
    expected = [tok.encode(t).tolist() for t in texts]
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(lambda t: tok.encode(t).tolist(), texts))
        decoded = list(pool.map(tok.decode, got))
    assert got == expected
    assert decoded == texts


def test_a_text_of_the_longest_tokens_is_measured_exactly(tok):
    """The bound is tight: k copies of the longest token are k tokens and k * max chars."""
    longest = max(range(tok.vocab_size), key=lambda i: len(tok.id_to_token(i)))
    piece = tok.decode([longest], skip_special_tokens=False)
    assert len(piece) == tok.max_token_chars == 81        # "\n" and 80 spaces
    for k in (1, 7, 50):
        n = len(tok.encode(piece * k))
        assert n == k and not tok.surely_too_long(piece * k, n)
        assert tok.surely_too_long(piece * k, n - 1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 49151), min_size=1, max_size=60), st.integers(0, 80))
def test_a_text_called_too_long_never_fits(tok, ids, limit):
    """Texts made of vocabulary tokens (long ones, special ones, any): surely_too_long(text,
    m) only if the text encodes to more than m tokens."""
    text = tok.decode(ids, skip_special_tokens=False)
    n = len(tok.encode(text, add_special_tokens=False))
    assert not tok.surely_too_long(text, n)
    assert not tok.surely_too_long(text, limit) or n > limit


def test_a_normalizer_that_shrinks_text_is_counted_after_it():
    from tokenizers import Tokenizer as Backend, models, normalizers, pre_tokenizers

    from splitserve.model.tokenizer import Tokenizer
    backend = Backend(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    t = Tokenizer(backend, bos_token_id=None, eos_token_ids=(), chat_template=None,
                  add_bos=False, name="strip-accents")
    assert t.max_token_chars == 5
    marks = "a" + "\u0301" * 1000                     # one accented "a": 1 token
    assert len(t.encode(marks)) == 1 and not t.surely_too_long(marks, 1)
    assert t.surely_too_long("a " * 1000, 199) and not t.surely_too_long("a " * 1000, 1000)
