"""Counting a prompt's tokens in the orchestrator, and where the decision sends it."""

import asyncio

import numpy as np
import pytest

from splitserve.model.loader import load_model_source
from splitserve.orchestrator.cluster import ClusterConfig, Server
from splitserve.orchestrator.decide import Decider
from splitserve.orchestrator.kv_index import Held
from splitserve.orchestrator.metrics import OrchestratorMetrics
from splitserve.orchestrator.prompt_tokens import PromptTokenizer, text_bound
from splitserve.protocol.block_hashes import chain_hashes

TEXTS = ["", "a", "Hello, world!", "héllo wörld " * 20, "日本語のテキスト" * 30, "🙂🚀" * 40,
         "   spaces   and\ttabs\n\n", "<|im_start|>user\nhi<|im_end|>" * 5]


@pytest.fixture(scope="module")
def counter():
    return PromptTokenizer("tiny-random")


@pytest.mark.parametrize("text", TEXTS)
def test_the_byte_bound_is_never_below_the_token_count(counter, text):
    ids = counter.token_ids({"prompt": text})
    assert ids is not None and len(ids) <= text_bound(text)
    assert PromptTokenizer.surely_within({"prompt": text}, text_bound(text))
    assert not PromptTokenizer.surely_within({"prompt": text}, text_bound(text) - 1)


def test_token_ids_are_the_workers(counter):
    tok = load_model_source("tiny-random").tokenizer
    assert np.array_equal(counter.token_ids({"prompt": "Once upon a time"}),
                          tok.encode("Once upon a time"))
    assert np.array_equal(counter.token_ids({"prompt": [[5, 6, 7]]}), [5, 6, 7])
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    # as server/generate.py renders it: the template, then no special tokens added
    want = tok.encode(tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Hi"}],
                                              add_generation_prompt=True),
                      add_special_tokens=False)
    assert np.array_equal(counter.token_ids({"messages": messages}), want)


def test_what_cannot_be_counted_is_none(counter):
    within = PromptTokenizer.surely_within
    assert not within({"messages": [{"role": "user", "content": "x"}]}, 1000)
    assert not within({"prompt": ["a", "b"]}, 1000)
    assert within({"prompt": [1, 2, 3]}, 3) and not within({"prompt": [1, 2, 3]}, 2)
    for body in ({"prompt": ["a", "b"]}, {"prompt": [1, "x"]}, {"prompt": [2**40]},
                 {"messages": [{"role": "nobody"}]}, {"messages": "hi"}):
        assert counter.token_ids(body) is None
    assert PromptTokenizer(None).token_ids({"prompt": "text needs a tokenizer"}) is None


def test_a_text_no_worker_context_holds_is_not_encoded(counter):
    """tiny-random: 262,144 positions of at most 81 characters each. Past that the text is
    not counted (its CTX refuses it, also before encoding)."""
    limit = counter.max_tokens * counter.tokenizer.max_token_chars
    assert counter.max_tokens == 262_144
    assert counter.token_ids({"prompt": "x" * (limit + 1)}) is None
    assert counter.token_ids({"messages": [{"role": "user", "content": "x" * limit}]}) is None
    assert len(counter.token_ids({"prompt": "ab" * 1000})) == 1000
    many = [{"role": "user", "content": ""}] * (counter.max_tokens + 1)
    assert counter.token_ids({"messages": many}) is None
    assert len(counter.token_ids({"messages": many[:3]})) > 3


# -- the decision ------------------------------------------------------------------------
class _Headers:
    """A client request as the decision reads it: its headers."""

    def __init__(self, **headers):
        self.headers = headers

    def header(self, name):
        return self.headers.get(name)


def decider(threshold, model="tiny-random", **pools):
    pool = {"urls": ["http://ctx:1"], "router": pools.get("ctx_router", "round_robin")}
    config = ClusterConfig.from_dict({"context_servers": pool,
                                      "generation_servers": ["http://gen:1"],
                                      "local_prefill_max_tokens": threshold, "model": model})
    return Decider(config, OrchestratorMetrics())


def plan(d, body, gens=(), ctxs=()):
    return asyncio.run(d.plan(_Headers(), body, list(ctxs), list(gens)))


def test_short_prompts_are_prefilled_on_gen_long_ones_on_ctx():
    d = decider(16)
    assert (plan(d, {"prompt": "hi"}).local, plan(d, {"prompt": "hi"}).reason) == (
        True, "short_prompt")                                     # by the byte bound
    assert plan(d, {"prompt": list(range(16))}).local
    long = plan(d, {"prompt": list(range(17))})
    assert (long.local, long.reason, long.info.num_tokens) == (False, "long_prompt", 17)
    # over the byte bound, under the threshold once tokenized
    words = plan(d, {"prompt": "the " * 10})
    assert words.local and words.info.num_tokens <= 16
    assert plan(d, {"prompt": "x", "n": 2}).reason == "needs_aggregated"
    assert d.count.labels("gen", "short_prompt").value == 4


def test_without_a_tokenizer_only_the_bound_decides():
    d = decider(16, model=None)
    assert plan(d, {"prompt": "hi"}).local
    assert plan(d, {"prompt": "a much longer prompt than sixteen bytes"}).reason == "not_counted"
    assert plan(d, {"messages": [{"role": "user", "content": "hi"}]}).reason == "not_counted"


def test_off_counts_nothing_and_sends_everything_to_ctx():
    d = decider(0)
    p = plan(d, {"prompt": "hi"})
    assert (p.local, p.reason, p.info.num_tokens, d.index) == (False, "off", None, None)


def test_a_gen_holding_the_prompt_prefills_it_and_is_pinned():
    d = decider(8)
    ids = np.arange(100, 164, dtype=np.int32)
    gens = [Server("http://gen:1", healthy=True), Server("http://gen:2", healthy=True)]
    d.index.held[gens[1].url] = Held("v", 16, frozenset(chain_hashes(b"", ids, 16)))
    p = plan(d, {"prompt": ids.tolist() + [7, 8, 9]}, gens)
    assert (p.local, p.reason, p.info.pin) == (True, "gen_prefix_hit", gens[1].url)
    # more than 8 tokens missing: the split path
    p = plan(d, {"prompt": ids.tolist() + list(range(20))}, gens)
    assert (p.local, p.reason, p.info.pin) == (False, "long_prompt", None)
    gens[1].healthy = False
    assert not plan(d, {"prompt": ids.tolist() + [7, 8, 9]}, gens).local
