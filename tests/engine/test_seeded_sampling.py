"""Seeded sampling is a pure function of (seed, output position): the same text aggregated
or split between a CTX and a GEN (prompt relayed as tokens or as its length only), resumed
after a migration at any point, and alone or in a crowded batch."""

import numpy as np
import pytest
import torch

from splitserve.engine import seeded
from splitserve.protocol.engine import RemotePrefill
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens

from disagg_utils import BACKENDS, PROMPT, drain, engine, handoff, require_backend, tokens
from disagg_utils import wait_for_release
from engine_requests import add_request
from test_sampler import make_req, sampler

SEEDED = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, ignore_eos=True, seed=1234)


def u(seeds, positions):
    return seeded.uniforms(torch.tensor(seeds, dtype=torch.int64),
                           torch.tensor(positions, dtype=torch.int64))


# -- the counter-based draw -------------------------------------------------------------

def test_a_uniform_depends_on_its_seed_and_position_only():
    a = u([7, 7, -2**63, 2**63 - 1], [0, 5, 3, 3])
    b = u([2**63 - 1, 7, 11, -2**63, 7], [3, 5, 0, 3, 0])
    assert a[0] == b[4] and a[1] == b[1] and a[2] == b[3] and a[3] == b[0]
    assert a.dtype == torch.float64 and bool(((a >= 0) & (a < 1)).all())


def test_uniforms_are_uniform_and_distinct_over_positions_and_seeds():
    n = 200_000
    x = u([99] * n, list(range(n)))
    assert len(torch.unique(x)) == n
    assert abs(float(x.mean()) - 0.5) < 0.005 and abs(float(x.var()) - 1 / 12) < 0.002
    counts = torch.histc(x.float(), bins=20, min=0, max=1)
    assert float((counts / n - 0.05).abs().max()) < 0.003
    y = u(list(range(n)), [0] * n)                # neighbouring seeds, one position
    assert len(torch.unique(y)) == n and abs(float(y.mean()) - 0.5) < 0.005
    assert abs(float(np.corrcoef(x.numpy()[:-1], x.numpy()[1:])[0, 1])) < 0.01


def test_the_inverse_cdf_never_picks_a_token_of_probability_zero():
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0]] * 4, dtype=torch.float32)
    picks = seeded.sample(probs, torch.tensor([0.0, 0.31, 0.29, 1 - 2**-53],
                                               dtype=torch.float64))
    assert picks.tolist() == [1, 3, 1, 3]


def test_a_seeded_row_follows_the_softmax_over_positions():
    logits = torch.tensor([1.0, 0.0, -1.0])
    req, s, got = make_req("r", seed=5), sampler(vocab=3), []
    for _ in range(3000):
        got.append(s(logits[None], [req]).token_ids[0])
        req.output_token_ids.append(got[-1])
    freqs = np.bincount(got, minlength=3) / len(got)
    assert np.abs(freqs - torch.softmax(logits, -1).numpy()).max() < 0.03


def test_a_seeded_token_is_the_same_in_any_row_of_any_batch():
    row = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    alone = sampler()(row[None], [make_req("a", seed=9, out=[1] * 4)]).token_ids[0]
    for size in (2, 7, 64):
        logits = torch.randn(size, 1000)
        logits[size // 2] = row
        reqs = [make_req(f"x{i}", seed=i if i % 2 else None, temperature=0.0 if i % 3 else 1.0)
                for i in range(size)]
        reqs[size // 2] = make_req("a", seed=9, out=[2] * 4)   # output values do not matter
        assert sampler(seed=size)(logits, reqs).token_ids[size // 2] == alone


# -- one seeded request's text, whatever happens to it ------------------------------------

@pytest.fixture(scope="module", params=BACKENDS)
def pair(request, tiny_source):
    require_backend(request.param)
    ctx, gen = engine(tiny_source, request.param), engine(tiny_source, request.param)
    yield ctx, gen
    for e in (ctx, gen):
        e.remote_kv.close()


def aggregated(e, rid, params=SEEDED, resumed=None):
    add_request(e, rid, PROMPT, params, resumed=resumed)
    return tokens(drain(e))


@pytest.mark.parametrize("prompt", ["tokens", "length only"])
def test_split_equals_aggregated(pair, prompt):
    ctx, gen = pair
    want = aggregated(ctx, "agg")
    assert len(set(want)) > 6                 # the draws really were random
    first = handoff(ctx, "c", params=SEEDED)
    relayed = PROMPT if prompt == "tokens" else PromptTokens.placeholder(len(PROMPT))
    add_request(gen, "g", relayed, SEEDED,
                remote=RemotePrefill(first.kv_handle, first.token_ids, first.logprobs))
    assert first.token_ids == want[:1]
    assert tokens(drain(gen)) == want          # the GEN streams the CTX's first token too
    wait_for_release(ctx)


@pytest.mark.parametrize("cut", [1, 4, 11])
def test_a_resumed_seeded_stream_continues_the_same_text(pair, cut):
    ctx, gen = pair
    want = aggregated(ctx, "whole")
    assert aggregated(gen, "moved", resumed=np.asarray(want[:cut], np.int32)) == want[cut:]


def test_a_seeded_request_decodes_the_same_in_a_crowd(pair):
    ctx, _ = pair
    want = aggregated(ctx, "alone")
    others = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    for i in range(5):
        add_request(ctx, f"other{i}", PromptTokens(PROMPT.array[i:]), others)
    add_request(ctx, "crowded", PROMPT, SEEDED)
    got = tokens([d for d in drain(ctx) if d.request_id == "crowded"])
    assert got == want
    other_seed = SamplingParams(**{**_fields(SEEDED), "seed": 4321})
    assert aggregated(ctx, "other-seed", other_seed) != want


def _fields(params):
    return {f: getattr(params, f) for f in params.__struct_fields__}


def test_bench_engine_times_the_sampler_for_each_kind_of_row():
    from splitserve.bench.engine.sampler_timing import KINDS, sampler_ms
    ms = sampler_ms(1000, [1, 4], reps=2)
    assert set(ms) == set(KINDS) and all(set(v) == {"1", "4"} for v in ms.values())
    assert all(t > 0 for v in ms.values() for t in v.values())
