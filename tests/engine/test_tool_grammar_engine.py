"""tool_choice required and named in the engine with tiny-random: the calls' grammar makes
every answer one or more calls the hermes parser reads, arguments satisfying the tool's
schema; a split request's GEN resumes it from first_gen_tokens (any relay mode's prompt)."""

import json

import pytest

from splitserve.engine.request import FinishReason
from splitserve.protocol.engine import RemotePrefill
from splitserve.protocol.openai import decode_chat_request
from splitserve.protocol.tool_parsers import get_parser
from splitserve.protocol.tools import with_tools
from splitserve.tokens import PromptTokens

from disagg_utils import PROMPT, drain, engine, handoff, serving, tokens
from engine_requests import add_request
from tool_utils import TOOLS, satisfied

HERMES = get_parser("hermes")


@pytest.fixture(scope="module")
def pair(tiny_source):
    yield from serving(engine(tiny_source), engine(tiny_source))


def params(tool_choice, **extra):
    req = decode_chat_request(json.dumps({
        "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 80,
        "tool_choice": tool_choice, **extra}).encode())
    return with_tools(req, req.sampling_params(), HERMES)[0]


def calls_of(e, deltas):
    text = e.tokenizer.decode(tokens(deltas))
    content, calls = HERMES.parse(text)
    assert content is None and calls, text
    return calls


@pytest.mark.parametrize("choice, extra", [
    ("required", {"temperature": 0}),
    ("required", {"temperature": 1.0, "seed": 3, "n": 3}),
    ({"type": "function", "function": {"name": "get_weather"}},
     {"temperature": 0, "parallel_tool_calls": False}),
    ({"type": "function", "function": {"name": "now"}}, {"temperature": 1.0, "seed": 1}),
])
def test_required_and_named_answers_are_calls_that_satisfy_the_schema(pair, choice, extra):
    ctx, _ = pair
    p = params(choice, **extra)
    add_request(ctx, f"t{json.dumps(choice)}{extra}", PROMPT, p)
    out = drain(ctx)
    by_index = {}
    for d in out:
        by_index.setdefault(d.index, []).append(d)
    assert len(by_index) == p.n
    for ds in by_index.values():
        assert ds[-1].finish_reason == FinishReason.STOP
        for call in calls_of(ctx, ds):
            assert satisfied(call.name, call.arguments), call
            if isinstance(choice, dict):
                assert call.name == choice["function"]["name"]


def test_parallel_tool_calls_false_makes_one_call(pair):
    ctx, _ = pair
    for seed in range(3):
        add_request(ctx, f"one{seed}", PROMPT, params("required", temperature=1.0, seed=seed,
                                                       parallel_tool_calls=False))
        assert len(calls_of(ctx, drain(ctx))) == 1


@pytest.mark.parametrize("placeholder", [False, True])
def test_disaggregated_equals_aggregated_under_the_calls_grammar(pair, placeholder):
    ctx, gen = pair
    p = params("required", temperature=0)
    add_request(ctx, f"agg{placeholder}", PROMPT, p)
    want = tokens(drain(ctx))
    first = handoff(ctx, f"ctx{placeholder}", params=p)
    prompt = PromptTokens.placeholder(len(PROMPT)) if placeholder else PROMPT
    add_request(gen, f"gen{placeholder}", prompt, p,
                remote=RemotePrefill(first.kv_handle, first.token_ids))
    out = drain(gen)
    assert tokens(out) == want
    assert out[-1].finish_reason == FinishReason.STOP
