"""Greedy output equals Hugging Face transformers' token for token (float32, the same
weights in both): chunked prefill, a cached prefix, a batch of several prompts."""

import pytest

pytest.importorskip("transformers")

from splitserve.bench.hf_equality import check  # noqa: E402


@pytest.mark.parametrize("model, load_format", [("tiny-random", "auto"),
                                                ("tiny-llama", "dummy")])
def test_greedy_equals_transformers(model, load_format):
    result = check(model, load_format, n=3, max_tokens=8)
    assert result.equal == result.prompts, result.line()
