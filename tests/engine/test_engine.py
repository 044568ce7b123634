"""The paged, batched engine against a naive full-recompute forward (tests/support/reference_model.py)."""

import time

import numpy as np
import pytest
import torch

from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.engine.core import EngineCore
from splitserve.engine.request import FinishReason
from splitserve.errors import InvalidRequestError
from splitserve.llm import RequestOutput, CompletionOutput
from splitserve.model.loader import load_model_source
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens

from reference_model import ReferenceModel
from engine_requests import add_request


@pytest.fixture(scope="module")
def source():
    return load_model_source("tiny-random")


@pytest.fixture(scope="module")
def reference(source):
    return ReferenceModel(source, dtype=torch.float32)


@pytest.fixture
def make_engine(source):
    engines = []

    def make(num_blocks=256, block_size=4, budget=64, max_seqs=16, prefix=True, **kw):
        cfg = EngineConfig(model="tiny-random", dtype="float32", seed=0,
                           cache=CacheConfig(block_size, num_blocks, enable_prefix_caching=prefix),
                           scheduler=SchedulerConfig(budget, max_seqs), **kw)
        engine = EngineCore(cfg, source)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:   # every test must leave every block free
        bm = engine.block_manager
        assert not engine.has_unfinished_requests()
        assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def prompts(lengths, seed=0, vocab=49152):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).astype(np.int32) for n in lengths]


def run(engine, items, params):
    """items: token arrays; returns RequestOutputs, stepping until all finish."""
    params = params if isinstance(params, list) else [params] * len(items)
    results = {}
    for i, (toks, p) in enumerate(zip(items, params)):
        add_request(engine, f"r{i}", PromptTokens(toks), p)
        results[f"r{i}"] = RequestOutput(f"r{i}", None, PromptTokens(toks),
                                         [CompletionOutput(j) for j in range(p.n)])
    steps = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            results[delta.request_id].add(delta)
        steps += 1
        assert steps < 10_000
    return [results[f"r{i}"] for i in range(len(items))]


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def expected(reference, items, max_tokens=10):
    return [reference.greedy(t.tolist(), max_tokens, eos_ids=()) for t in items]


@pytest.mark.parametrize("budget", [64, 7])   # 7: prompts prefill in several chunks
def test_greedy_batch_matches_reference(make_engine, reference, budget):
    items = prompts([1, 5, 17, 40, 3, 23])
    outs = run(make_engine(budget=budget), items, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected(reference, items)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_prefix_cache_hits_give_same_output(make_engine, reference):
    engine = make_engine()
    shared = prompts([32])[0]
    first = np.concatenate([shared, prompts([5], seed=1)[0]])
    second = np.concatenate([shared, prompts([9], seed=2)[0]])
    run(engine, [first], GREEDY)
    out = run(engine, [second], GREEDY)[0]
    assert out.num_cached_tokens == 32
    assert out.outputs[0].token_ids == expected(reference, [second])[0]


def test_preemption_recomputes_exactly(make_engine, reference):
    # 24 blocks of 4 tokens cannot hold four 30-token sequences at once.
    engine = make_engine(num_blocks=24, prefix=False)
    items = prompts([14, 18, 12, 16], seed=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    preempted = []
    orig = engine.scheduler._preempt
    engine.scheduler._preempt = lambda r: (preempted.append(r.request_id), orig(r))
    outs = run(engine, items, params)
    assert preempted, "the test must actually preempt"
    assert [o.outputs[0].token_ids for o in outs] == expected(reference, items, 16)


def test_prompt_logprobs_match_reference_logits(make_engine, reference):
    items = prompts([21], seed=4)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2, logprobs=3)
    out = run(make_engine(budget=8), items, params)[0]
    ref = torch.log_softmax(reference.logits(items[0].tolist()), dim=-1)   # (T, V)
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == 21
    for pos in range(1, 21):
        assert plp[pos].token_id == items[0][pos]
        assert plp[pos].logprob == pytest.approx(ref[pos - 1, items[0][pos]].item(), abs=1e-4)
        top = torch.topk(ref[pos - 1], 2)
        assert [t for t, _ in plp[pos].top] == top.indices.tolist()
    lp = out.outputs[0].logprobs[0]
    assert lp.rank == 1 and lp.token_id == int(ref[-1].argmax())
    assert lp.logprob == pytest.approx(ref[-1].max().item(), abs=1e-4)
    assert len(lp.top) == 3


def test_seeded_sampling_is_reproducible_in_any_batch(make_engine):
    items = prompts([9, 13, 6], seed=5)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    engine = make_engine()
    alone = run(engine, [items[1]], seeded)[0].outputs[0].token_ids
    batched = run(engine, items, [other, seeded, other])[1].outputs[0].token_ids
    assert alone == batched


def test_n_siblings_share_prompt_blocks(make_engine, reference):
    engine = make_engine()
    items = prompts([10], seed=6)
    shared_refs = []
    orig = engine._fork_siblings

    def spy(leader, out):
        forked = orig(leader, out)
        if forked:
            shared_refs.append(engine.block_manager.ref_counts[leader.block_ids[0]])
        return forked

    engine._fork_siblings = spy
    out = run(engine, items, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12,
                                            ignore_eos=True))[0]
    assert shared_refs == [3]
    seqs = [o.token_ids for o in out.outputs]
    assert len({tuple(s) for s in seqs}) == 3, "siblings with different seeds must differ"
    greedy = run(engine, items, SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert [o.token_ids for o in greedy.outputs] == expected(reference, items) * 2


def test_stop_token_and_stop_string(make_engine, source):
    engine = make_engine()
    items = prompts([12], seed=8)
    base = run(engine, items, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    toks, text = base.outputs[0].token_ids, base.outputs[0].text
    stop_tok = toks[4]
    first = toks.index(stop_tok)
    out = run(engine, items, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop_tok,)))[0]
    assert out.outputs[0].token_ids == toks[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = text.index(stop)
    out = run(engine, items, SamplingParams(temperature=0, max_tokens=12, stop=(stop,)))[0].outputs[0]
    assert out.text == text[:cut] and out.stop_reason == stop and out.finish_reason == "stop"
    out = run(engine, items, SamplingParams(temperature=0, max_tokens=12, stop=(stop,),
                                            include_stop_str_in_output=True))[0].outputs[0]
    assert out.text == text[:cut + len(stop)]


def test_eos_stops_unless_ignored_and_min_tokens_delays_it(make_engine, reference, source):
    engine = make_engine()
    items = prompts([8], seed=9)
    toks = expected(reference, items, 6)[0]
    eos = toks[2]   # pretend the model's third greedy token is an end-of-sequence token
    engine.model_config = type(engine.model_config)(**{**engine.model_config.__dict__, "eos_token_ids": (eos,)})
    out = run(engine, items, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert out.token_ids == toks[:3] and out.finish_reason == "stop"
    out = run(engine, items, SamplingParams(temperature=0, max_tokens=6, min_tokens=4))[0].outputs[0]
    assert eos not in out.token_ids[:4]
    out = run(engine, items, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == toks and out.finish_reason == "length"


def test_frequency_penalty_reduces_repetition(make_engine):
    engine = make_engine()
    items = prompts([6], seed=10)
    plain = run(engine, items, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    penal = run(engine, items, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                              frequency_penalty=2.0, presence_penalty=2.0))[0]
    distinct = lambda o: len(set(o.outputs[0].token_ids))
    assert distinct(penal) > distinct(plain)


def test_abort_frees_blocks(make_engine):
    engine = make_engine()
    add_request(engine, "a", PromptTokens(prompts([30])[0]), SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    engine.abort_request("a")
    deltas = engine.step()
    assert any(d.request_id == "a" and d.finish_reason == FinishReason.ABORT for d in deltas)


@pytest.mark.parametrize("prompt, params, param", [
    ([], SamplingParams(), "prompt"),
    ([5, 49152], SamplingParams(), "prompt"),
    ([5, -1], SamplingParams(), "prompt"),
    (list(range(3, 2000)), SamplingParams(), "prompt"),
    (None, SamplingParams(), "prompt"),                       # length-only, no remote KV
    ([5, 6], SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
])
def test_bad_requests_are_rejected_with_the_parameter_named(make_engine, prompt, params, param):
    engine = make_engine(max_model_len=1024)
    with pytest.raises(InvalidRequestError) as err:
        tokens = PromptTokens.placeholder(6) if prompt is None else PromptTokens.from_list(prompt)
        add_request(engine, "x", tokens, params)
    assert err.value.param == param
    assert run(engine, prompts([4]), GREEDY)[0].outputs[0].finish_reason == "length"


def test_failed_request_ends_with_error_and_engine_keeps_serving(make_engine):
    engine = make_engine()
    real = engine.runner.execute

    def fail_once(scheduled):   # a fault inside the model step, once
        engine.runner.execute = real
        raise RuntimeError("injected fault")

    engine.runner.execute = fail_once
    add_request(engine, "bad", PromptTokens(prompts([8])[0]), GREEDY)
    deltas = engine.step()
    assert deltas[0].finish_reason == FinishReason.ERROR and "running the model" in deltas[0].error
    assert "injected fault" not in deltas[0].error   # the client sees no internal exception
    out = run(engine, prompts([5]), GREEDY)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 10


def test_admission_is_when_the_engine_received_it_and_waiting_for_a_step_is_queue_time(make_engine):
    """A request received 0.25 s before EngineCore.add_request (it waited for a step to
    end) reports admit_time = the receipt and a queue time that includes those 0.25 s."""
    engine = make_engine()
    received = time.time() - 0.25
    add_request(engine, "a", PromptTokens(prompts([8])[0]), SamplingParams(max_tokens=2),
                       received_time=received)
    first = next(d for _ in range(4) for d in engine.step() if d.token_ids)
    assert first.admit_time == received
    assert 0.25 <= first.queue_time < 5
    while engine.has_unfinished_requests():
        engine.step()


def _all_deltas(engine):
    out = []
    while engine.has_unfinished_requests():
        out += engine.step()
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, prompt_logprobs=2),
    SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=7, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
], ids=["prompt-logprobs", "n2", "one-token"])
def test_a_response_sent_whole_gets_one_delta_per_sequence_equal_to_the_stream(make_engine, params):
    items = prompts([7, 13], seed=11)
    streamed, whole = make_engine(), make_engine()
    for i, toks in enumerate(items):
        add_request(streamed, f"r{i}", PromptTokens(toks), params)
        add_request(whole, f"r{i}", PromptTokens(toks), params, stream=False)
    a, b = _all_deltas(streamed), _all_deltas(whole)
    assert len(a) > len(b) or params.max_tokens == 1
    assert sorted((d.request_id, d.index) for d in b) == sorted(
        (f"r{i}", j) for i in range(len(items)) for j in range(params.n))
    t0 = time.time()
    for d in b:
        mine = [x for x in a if (x.request_id, x.index) == (d.request_id, d.index)]
        assert d.token_ids == [t for x in mine for t in x.token_ids]
        assert d.text == "".join(x.text for x in mine)
        assert d.finish_reason == mine[-1].finish_reason
        assert d.num_prompt_tokens == mine[0].num_prompt_tokens > 0
        assert d.prompt_logprobs == mine[0].prompt_logprobs
        assert t0 - 60 < d.first_token_time <= t0 and d.admit_time <= d.first_token_time
        assert all(x.first_token_time == 0.0 for x in mine)   # streamed deltas carry none


def test_a_response_sent_whole_with_logprobs_gets_its_deltas_per_step(make_engine):
    """Held, a sequence's logprobs would leave as one message of the whole response's (the
    front-end decodes it on its event loop): they leave as a stream's do."""
    params = SamplingParams(n=2, temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
    streamed, whole = make_engine(), make_engine()
    add_request(streamed, "r", PromptTokens(prompts([9])[0]), params)
    add_request(whole, "r", PromptTokens(prompts([9])[0]), params, stream=False)
    a, b = _all_deltas(streamed), _all_deltas(whole)
    assert len(b) == len(a) == 2 * 5 and not whole.output.final_only
    assert [(d.index, d.token_ids, d.logprobs) for d in b] == [
        (d.index, d.token_ids, d.logprobs) for d in a]


def test_an_aborted_response_sent_whole_returns_what_it_generated(make_engine):
    engine = make_engine()
    add_request(engine, "a", PromptTokens(prompts([9])[0]),
                       SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), stream=False)
    assert engine.step() == [] and engine.step() == [] and engine.step() == []
    engine.abort_request("a")
    (d,) = engine.step()
    assert d.finish_reason == FinishReason.ABORT and len(d.token_ids) == 3 and d.first_token_time > 0
    assert not engine.output.final_only
