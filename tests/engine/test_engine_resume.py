"""Mid-stream migration inside the engine: a request resumed after tokens another worker
already streamed continues exactly as the uninterrupted request would have."""

import numpy as np
import pytest

from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.engine.core import EngineCore
from splitserve.engine.request import FinishReason
from splitserve.errors import InvalidRequestError
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens
from engine_requests import add_request

PROMPT = np.arange(100, 137, dtype=np.int32)


@pytest.fixture
def engine(tiny_source):
    cfg = EngineConfig(model="tiny-random", dtype="float32", seed=0,
                       cache=CacheConfig(4, 256), scheduler=SchedulerConfig(64, 8))
    e = EngineCore(cfg, tiny_source)
    yield e
    assert not e.has_unfinished_requests()
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


def drain(engine, rid, prompt, params, resumed=None):
    """(tokens, text streamed with each token, first delta with tokens, finish reason)."""
    add_request(engine, rid, PromptTokens(prompt), params, resumed=resumed)
    tokens, texts, first, reason = [], [], None, None
    while engine.has_unfinished_requests():
        for d in engine.step():
            assert d.error is None, d.error
            first = first if first is not None or not d.token_ids else d
            tokens += d.token_ids
            texts += [d.text] if d.token_ids else []
            if not d.token_ids:          # a flush at the finish
                texts[-1] += d.text
            reason = d.finish_reason if d.finish_reason is not None else reason
    return tokens, texts, first, reason


@pytest.mark.parametrize("cut", [1, 5, 11])
def test_resumed_greedy_equals_uninterrupted(engine, cut):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            frequency_penalty=0.5, presence_penalty=0.3)
    want, want_texts, _, want_reason = drain(engine, "a", PROMPT, params)
    rest, rest_texts, first, reason = drain(engine, "b", PROMPT, params,
                                            resumed=np.asarray(want[:cut], np.int32))
    assert rest == want[cut:]
    assert reason == want_reason == int(FinishReason.LENGTH)
    # The client saw the text streamed with the first `cut` tokens, then the rest.
    assert "".join(want_texts[:cut] + rest_texts) == "".join(want_texts)
    assert first.num_prompt_tokens == len(PROMPT)


def test_text_held_back_for_a_stop_string_is_not_lost_across_the_cut(engine):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want, want_texts, _, _ = drain(engine, "a", PROMPT, params)
    text = "".join(want_texts)
    # A stop string that never matches but whose prefix ends the text at token 9: the
    # detokenizer holds that text back until the request ends.
    head = "".join(want_texts[:9])
    stop = head[-2:] + "\x00"
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=(stop,))
    _, texts, _, _ = drain(engine, "b", PROMPT, params)
    assert "".join(texts) == text and "".join(texts[:9]) != head   # really held back
    rest, rest_texts, _, _ = drain(engine, "c", PROMPT, params, resumed=np.asarray(want[:9], np.int32))
    assert rest == want[9:]
    assert "".join(texts[:9] + rest_texts) == text


@pytest.mark.parametrize("resumed, message", [
    ([], "token ids"), ([-1], "token ids"), ([49152], "token ids"),
    (list(range(16)), "max_tokens")])
def test_resumed_tokens_are_checked(engine, resumed, message):
    params = SamplingParams(temperature=0, max_tokens=16)
    with pytest.raises(InvalidRequestError, match=message) as info:
        add_request(engine, "x", PromptTokens(PROMPT), params, resumed=np.asarray(resumed, np.int32))
    assert info.value.param == "disaggregated_params.resume_token_ids"
    assert not engine.has_unfinished_requests()
