"""A draining engine hands its decoding streams off with their KV leased, and another
engine pulls that KV and goes on: the output equals the uninterrupted run's, greedy and
seeded, and nothing is left leased or allocated."""

import numpy as np
import pytest

from splitserve.engine.request import FinishReason
from splitserve.errors import InvalidRequestError
from splitserve.protocol.engine import RemotePrefill
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens

from disagg_utils import PROMPT, drain, engine, serving, tokens, wait_for_release
from engine_requests import add_request

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tiny_source):
    yield from serving(engine(tiny_source), engine(tiny_source))


def _hand_off(old, rid, params, after: int):
    """Runs rid on `old` until it streamed `after` tokens, then drains `old`: (the tokens
    streamed, the HANDOFF delta)."""
    add_request(old, rid, PROMPT, params, movable=True)
    streamed = tokens(drain(old, until=lambda d: len(tokens(d)) >= after))
    old.drain()
    (last,) = old.step()
    old.undrain(0)
    assert last.finish_reason == FinishReason.HANDOFF and not last.token_ids
    return streamed, last


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_moved_stream_equals_the_uninterrupted_one(pair, params):
    old, new = pair
    add_request(old, "whole", PROMPT, params)
    want = tokens(drain(old))
    streamed, last = _hand_off(old, "moving", params, after=7)
    handle = last.kv_handle
    assert handle.num_tokens == len(PROMPT) + len(streamed) - 1
    assert old.remote_kv.num_leased_blocks == -(-handle.num_tokens // 4)
    add_request(new, "moved", PromptTokens.placeholder(len(PROMPT)), params,
                remote=RemotePrefill(handle, []), resumed=np.array(streamed, np.int32))
    rest = drain(new)
    assert streamed + tokens(rest) == want
    assert rest[-1].finish_reason == FinishReason.LENGTH
    wait_for_release(old)
    for e in pair:
        assert e.remote_kv.num_leased_blocks == 0
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


def test_only_movable_streams_of_the_draining_front_end_are_handed_off(pair):
    old, _ = pair
    add_request(old, "stays", PROMPT, GREEDY)                    # not movable
    add_request(old, "elsewhere", PROMPT, GREEDY, movable=True, peer=1)
    add_request(old, "reads", PROMPT, SamplingParams(max_tokens=20, ignore_eos=True,
                                                     repetition_penalty=1.2), movable=True)
    old.drain()
    deltas = drain(old)
    old.undrain(0)
    assert not [d for d in deltas if d.finish_reason == FinishReason.HANDOFF]
    assert {d.request_id for d in deltas if d.finish_reason == FinishReason.LENGTH} == \
        {"stays", "reads", "elsewhere"}


def test_a_handle_for_other_token_counts_is_refused(pair):
    old, new = pair
    streamed, last = _hand_off(old, "short", GREEDY, after=3)
    with pytest.raises(InvalidRequestError, match="disagree"):
        add_request(new, "wrong", PromptTokens.placeholder(len(PROMPT)), GREEDY,
                    remote=RemotePrefill(last.kv_handle, []), resumed=np.array(streamed[:-1], np.int32))
    add_request(new, "right", PromptTokens.placeholder(len(PROMPT)), GREEDY,
                remote=RemotePrefill(last.kv_handle, []), resumed=np.array(streamed, np.int32))
    drain(new)
    wait_for_release(old)
    assert old.remote_kv.num_leased_blocks == 0
