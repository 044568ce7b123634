"""Structured output in the engine with tiny-random: every answer the grammar lets finish
matches it, in every sampling mode, and a split request resumes the grammar on its GEN."""

import json

import numpy as np
import pytest

from splitserve.engine.grammar import GrammarFailed, advance, start_matcher
from splitserve.engine.request import FinishReason
from splitserve.protocol.engine import RemotePrefill
from splitserve.protocol.grammar import CHOICE, JSON, REGEX, GrammarSpec
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens

from disagg_utils import PROMPT, drain, engine, handoff, serving, tokens
from engine_requests import add_request

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
          "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
JSON_SPEC = GrammarSpec(JSON, json.dumps(SCHEMA), "response_format")
CHOICES = ["yes", "no", "maybe"]
CHOICE_SPEC = GrammarSpec(CHOICE, json.dumps(CHOICES), "guided_choice")
REGEX_SPEC = GrammarSpec(REGEX, r"[0-9]{3}-[a-z]{2}", "guided_regex")


@pytest.fixture(scope="module")
def pair(tiny_source):
    yield from serving(engine(tiny_source), engine(tiny_source))


def params(spec, **kw):
    kw.setdefault("max_tokens", 64)
    kw.setdefault("temperature", 0)
    return SamplingParams(grammar=spec, **kw)


def run(e, rid, p, prompt=PROMPT, **kw):
    add_request(e, rid, prompt, p, **kw)
    return drain(e)


def texts(e, deltas):
    by_index = {}
    for d in deltas:
        by_index.setdefault(d.index, []).extend(d.token_ids)
    return {i: e.tokenizer.decode(ids) for i, ids in by_index.items()}


def finals(deltas):
    return {d.index: d.finish_reason for d in deltas if d.finish_reason is not None}


def test_json_schema_answers_parse_and_satisfy_the_schema(pair):
    ctx, _ = pair
    out = run(ctx, "j", params(JSON_SPEC))
    value = json.loads(texts(ctx, out)[0])
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)
    assert 0 <= value["n"] <= 9
    assert finals(out) == {0: FinishReason.STOP}


@pytest.mark.parametrize("spec,check", [
    (CHOICE_SPEC, lambda t: t in CHOICES),
    (REGEX_SPEC, lambda t: len(t) == 6 and t[:3].isdigit() and t[3] == "-"),
])
def test_choice_and_regex(pair, spec, check):
    ctx, _ = pair
    out = run(ctx, "c" + spec.kind, params(spec))
    assert check(texts(ctx, out)[0]) and finals(out) == {0: FinishReason.STOP}


def test_sampled_n_seeded_and_logprobs_stay_in_the_grammar(pair):
    ctx, _ = pair
    p = params(JSON_SPEC, temperature=1.0, top_p=0.9, top_k=50, n=3, seed=7, logprobs=3)
    out = run(ctx, "s", p)
    for text in texts(ctx, out).values():
        value = json.loads(text)
        assert set(value) == {"ok", "n"}
    # logprobs are the raw model's: the alternatives include tokens the grammar forbids.
    allowed_first = {ctx.tokenizer.encode("{", add_special_tokens=False)[0]}
    first = [d.logprobs[0] for d in out if d.logprobs][0]
    assert {tok for tok, _ in first.top} - allowed_first
    # seeded: the same tokens alone as beside an unseeded request
    again = run(ctx, "s2", p)
    assert texts(ctx, again) == texts(ctx, out)


def test_max_tokens_truncates_with_length_and_stop_strings_still_cut(pair):
    ctx, _ = pair
    out = run(ctx, "t", params(JSON_SPEC, max_tokens=3))
    assert finals(out) == {0: FinishReason.LENGTH} and len(tokens(out)) == 3
    out = run(ctx, "st", params(CHOICE_SPEC, stop=["y", "n", "m"]))
    assert finals(out) == {0: FinishReason.STOP}, out
    assert "".join(d.text for d in out) == "", out


def test_the_grammar_compiles_off_the_step_loop_and_is_cached(tiny_source):
    e = engine(tiny_source)
    spec = GrammarSpec(REGEX, "(ab)+c", "guided_regex")
    add_request(e, "first", PROMPT, params(spec, max_tokens=8))
    assert "first" in e.grammars and "first" not in e.groups   # waits for its grammar
    drain(e)
    add_request(e, "second", PROMPT, params(spec, max_tokens=8))
    assert "second" in e.groups                                # cached: admitted at once
    drain(e)
    add_request(e, "gone", PROMPT, params(GrammarSpec(REGEX, "x+y", "guided_regex")))
    e.abort_request("gone")
    (delta,) = drain(e)
    assert delta.finish_reason == FinishReason.ABORT and not e.has_unfinished_requests()
    e.remote_kv.close()


@pytest.mark.parametrize("placeholder", [False, True])
def test_disaggregated_equals_aggregated_under_a_grammar(pair, placeholder):
    ctx, gen = pair
    p = params(JSON_SPEC)
    want = tokens(run(ctx, f"agg{placeholder}", p))
    first = handoff(ctx, f"ctx{placeholder}", params=p)
    prompt = PromptTokens.placeholder(len(PROMPT)) if placeholder else PROMPT
    out = run(gen, f"gen{placeholder}", p, prompt,
              remote=RemotePrefill(first.kv_handle, first.token_ids))
    assert tokens(out) == want and finals(out) == {0: FinishReason.STOP}


def test_resumed_tokens_advance_the_grammar(pair):
    ctx, _ = pair
    p = params(JSON_SPEC)
    want = tokens(run(ctx, "whole", p))
    out = run(ctx, "resumed", p, resumed=np.asarray(want[:4], np.int32))
    assert want[:4] + tokens(out) == want


def test_final_only_output_and_a_bad_grammar_that_reached_the_engine(pair):
    ctx, _ = pair
    out = run(ctx, "whole", params(CHOICE_SPEC), stream=False)
    assert len(out) == 1 and out[0].text in CHOICES
    out = run(ctx, "bad", params(GrammarSpec(REGEX, "(a", "guided_regex")))
    assert finals(out) == {-1: FinishReason.ERROR} and "guided_regex" in out[0].error
    assert tokens(run(ctx, "after", params(CHOICE_SPEC)))          # the engine serves on


def test_a_token_outside_the_grammar_ends_only_its_request(pair):
    ctx, _ = pair
    template = ctx.grammars.compiler.compile(CHOICE_SPEC)
    matcher = start_matcher(template, [])
    with pytest.raises(GrammarFailed):
        advance(matcher, ctx.tokenizer.encode("{", add_special_tokens=False)[0])


def test_bench_engine_times_the_grammar_mask(pair):
    from splitserve.bench.engine.sampler_timing import sampler_ms
    ctx, _ = pair
    ms = sampler_ms(ctx.model_config.vocab_size, [2], reps=2, engine=ctx)
    assert ms["json_schema"]["2"] > 0 and "greedy" in ms


def test_bench_serve_sends_the_response_format():
    from splitserve.bench.serve.workloads import RESPONSE_FORMATS, Turn, request_body
    turn = Turn("hi", 1, 4)
    assert "response_format" not in request_body(turn, [], "m", True, False)
    body = request_body(turn, [], "m", True, False, "json_schema")
    assert body["response_format"] == RESPONSE_FORMATS["json_schema"]


def test_min_tokens_under_a_grammar_never_leaves_it(pair):
    """min_tokens forbids EOS only where the grammar allows more than EOS: an answer the
    grammar completes ends with stop even short of min_tokens (no illegal token, no hang);
    one the grammar lets go on goes on until min_tokens, still matching it."""
    ctx, _ = pair
    out = run(ctx, "mt1", params(GrammarSpec(CHOICE, '["yes"]', "guided_choice"), min_tokens=6))
    assert texts(ctx, out)[0] == "yes" and finals(out) == {0: FinishReason.STOP}
    out = run(ctx, "mt2", params(GrammarSpec(REGEX, "(ab)+", "guided_regex"), min_tokens=6))
    text = texts(ctx, out)[0]
    assert len(tokens(out)) >= 6 and finals(out) == {0: FinishReason.STOP}
    assert text and len(text) % 2 == 0 and text == "ab" * (len(text) // 2), text
