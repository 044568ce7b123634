"""A seeded request's logits are the same bits however its tokens were computed: alone, in a
batch with requests of other lengths (which moves its prefill chunks' boundaries), as the
sibling of an n > 1 request, from the prefix cache, or prefilled again with k generated
tokens after a migration. So its seeded draws (a pure function of probabilities, seed and
position: engine/seeded.py) cannot change either, even at a CDF boundary.

The logits are read where the engine hands them to its sampler; the default CPU float32
path (the C kernels, one torch thread) is what is checked."""

import numpy as np
import pytest
import torch

from splitserve.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from splitserve.engine.core import EngineCore
from splitserve.sampling_params import SamplingParams, sibling_seed
from splitserve.tokens import PromptTokens

from disagg_utils import drain
from engine_requests import add_request

BUDGET = 64                 # tokens a step: a 65-token prompt alone ends in a 1-token chunk
PROMPT = PromptTokens(np.random.default_rng(7).integers(3, 49152, BUDGET + 1).astype(np.int32))
SEEDED = SamplingParams(temperature=0.9, max_tokens=10, ignore_eos=True, seed=2027)


class Recorder:
    """The engine's own sampler, noting each row's logits first (by the client's request id
    and choice: sibling i of an n > 1 request is its own engine request)."""

    def __init__(self, sampler):
        self.sampler, self.vocab_size = sampler, sampler.vocab_size
        self.logits: dict[tuple[str, int], list[torch.Tensor]] = {}

    def __call__(self, logits, requests):
        for row, req in zip(logits, requests):
            self.logits.setdefault((req.group_id, req.index), []).append(row.clone())
        return self.sampler(logits, requests)


def make_engine(source, prefix_caching: bool):
    cfg = EngineConfig(model="tiny-random", dtype="float32", seed=0,
                       cache=CacheConfig(4, 256, enable_prefix_caching=prefix_caching),
                       scheduler=SchedulerConfig(BUDGET, 8), kv=KVTransferConfig(backend="tcp"))
    e = EngineCore(cfg, source)
    e.sampler = Recorder(e.sampler)
    return e


@pytest.fixture()
def engine(tiny_source):
    """Without a prefix cache: every run computes its prompt."""
    e = make_engine(tiny_source, prefix_caching=False)
    yield e
    e.remote_kv.close()


@pytest.fixture()
def cached_engine(tiny_source):
    e = make_engine(tiny_source, prefix_caching=True)
    yield e
    e.remote_kv.close()


def run(e, rid, params=SEEDED, prompt=PROMPT, resumed=None):
    """(the request's tokens by choice, their logits by choice), run with whatever is
    already waiting in the engine."""
    add_request(e, rid, prompt, params, resumed=resumed)
    tokens: dict[int, list[int]] = {}
    for d in drain(e):
        if d.request_id == rid:
            tokens.setdefault(d.index, []).extend(d.token_ids)
    return tokens, {i: e.sampler.logits[(rid, i)] for i in tokens}


def assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), (step, float((a - b).abs().max()))


def crowd(e, n=5):
    """Other requests, of other lengths, queued first: they share steps and token budget."""
    rng = np.random.default_rng(1)
    for i in range(n):
        length = (3, 40, 90, 17, 61)[i % 5]
        add_request(e, f"other{i}", PromptTokens(rng.integers(3, 49152, length).astype(np.int32)),
                    SamplingParams(temperature=0.8, max_tokens=14, ignore_eos=True))


def test_alone_and_in_a_crowd_give_the_same_logits(engine):
    alone_tokens, alone = run(engine, "alone")
    crowd(engine)
    tokens, logits = run(engine, "crowded")
    assert_bitwise(logits[0], alone[0])
    assert tokens == alone_tokens


def test_a_prefix_cache_hit_gives_the_same_logits(cached_engine):
    _, cold = run(cached_engine, "cold")
    _, warm = run(cached_engine, "warm")   # every full block cached: the last token alone
    assert_bitwise(warm[0], cold[0])


def test_an_n2_sibling_equals_a_single_request_with_its_seed(engine):
    pair_tokens, pair = run(engine, "pair", SamplingParams(**{**_fields(SEEDED), "n": 2}))
    for i in (0, 1):
        seed = sibling_seed(SEEDED.seed, i)
        tokens, logits = run(engine, f"single{i}", SamplingParams(**{**_fields(SEEDED), "seed": seed}))
        assert_bitwise(pair[i], logits[0])
        assert pair_tokens[i] == tokens[0]


@pytest.mark.parametrize("k", [1, 2, 7])
def test_a_re_prefill_of_prompt_and_k_tokens_gives_the_same_logits(engine, k):
    """The migration path: another worker prefills the prompt and the k tokens streamed so
    far in one chunk, where the first worker decoded them one at a time."""
    tokens, whole = run(engine, "whole")
    moved_tokens, moved = run(engine, "moved", resumed=np.asarray(tokens[0][:k], np.int32))
    assert_bitwise(moved[0], whole[0][k:])
    assert moved_tokens[0] == tokens[0][k:]


def _fields(params):
    return {f: getattr(params, f) for f in params.__struct_fields__}
