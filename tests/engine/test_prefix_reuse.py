"""Prefix reuse on a generation worker and prompt tokens over the KV pull, with two
in-process engines (KV over each backend; nixl's tests skip when it is not importable)."""

import numpy as np
import pytest

from splitserve.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from splitserve.engine.core import EngineCore
from splitserve.errors import InvalidRequestError
from splitserve.protocol.disagg import relayed_handle
from splitserve.protocol.engine import KVHandle, RemotePrefill
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens

from disagg_utils import (BACKENDS, GREEDY, drain, engine, handoff, require_backend, tokens,
                          wait_for_release)
from engine_requests import add_request

rng = np.random.default_rng(1)
SHARED = rng.integers(3, 49152, 40).astype(np.int32)          # 10 blocks of 4
A = PromptTokens(np.concatenate([SHARED, rng.integers(3, 49152, 7).astype(np.int32)]))
B = PromptTokens(np.concatenate([SHARED, rng.integers(3, 49152, 9).astype(np.int32)]))


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    require_backend(request.param)
    return request.param


@pytest.fixture
def pair(tiny_source, backend):
    ctx, gen = engine(tiny_source, backend), engine(tiny_source, backend)
    yield ctx, gen
    for e in (ctx, gen):
        e.remote_kv.close()


def reference(ctx, prompt, params=GREEDY):
    add_request(ctx, f"ref{len(prompt)}{params.repetition_penalty}", prompt, params)
    return tokens(drain(ctx))


def relay(ctx, gen, rid, prompt, params=GREEDY, length_only=True, handle=None, **kw):
    """CTX prefills prompt; GEN decodes it from the KV, given the length only or the tokens."""
    first = handoff(ctx, f"c-{rid}", prompt, params)
    remote = RemotePrefill(handle or first.kv_handle, first.token_ids, first.logprobs)
    given = PromptTokens.placeholder(len(prompt)) if length_only else prompt
    add_request(gen, rid, given, params, remote=remote, **kw)
    out = drain(gen)
    wait_for_release(ctx)
    return out


def pulled(gen):
    s = gen.remote_kv.stats
    return s.blocks_pulled, s.blocks_reused, s.bytes_pulled


def test_a_shared_prefix_is_pulled_once(pair):
    ctx, gen = pair
    want_a, want_b = reference(ctx, A), reference(ctx, B)
    assert tokens(relay(ctx, gen, "a", A)) == want_a
    assert pulled(gen)[:2] == (12, 0)                  # 47 tokens: 12 blocks, none cached
    out = relay(ctx, gen, "b", B)
    assert tokens(out) == want_b
    assert pulled(gen)[:2] == (12 + 3, 10)             # 49 tokens: the 10 shared blocks reused
    assert out[0].num_cached_tokens == 40
    block = gen.remote_kv.transport.block_nbytes
    assert pulled(gen)[2] == 15 * block
    # Relayed tokens hash to the same keys as the CTX's: a list/b64 relay of B finds all
    # 12 of its full blocks (10 shared, 2 filed by the pull above) and pulls its last.
    assert tokens(relay(ctx, gen, "b2", B, length_only=False)) == want_b
    assert pulled(gen)[:2] == (15 + 1, 10 + 12)
    for e in pair:
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


def test_a_prompt_cached_whole_pulls_no_block(pair):
    ctx, gen = pair
    prompt = PromptTokens(SHARED)                        # 40 tokens: full blocks only
    want = reference(ctx, prompt)
    assert tokens(relay(ctx, gen, "p1", prompt)) == want
    assert tokens(relay(ctx, gen, "p2", prompt)) == want
    assert pulled(gen)[:2] == (10, 10)
    assert ctx.remote_kv.num_leased_blocks == 0          # the empty pull acked its lease


def test_hashes_of_the_wrong_count_are_refused(pair):
    ctx, gen = pair
    first = handoff(ctx, "c-count", A)
    for raw in (first.kv_handle.block_hashes[:-16], first.kv_handle.block_hashes + bytes(16)):
        handle = KVHandle(**{**_fields(first.kv_handle), "block_hashes": raw})
        with pytest.raises(InvalidRequestError, match="11 full blocks") as err:
            add_request(gen, "bad", PromptTokens.placeholder(len(A)), GREEDY,
                        remote=RemotePrefill(handle, first.token_ids))
        assert err.value.param == "disaggregated_params.kv_handle"
    with pytest.raises(InvalidRequestError, match="16-byte hashes"):
        KVHandle(**{**_fields(first.kv_handle), "block_hashes": bytes(15)})


def test_garbage_hashes_cost_their_request_reuse_and_nobody_else_anything(pair):
    """Hashes no real prompt has: no hits, every block pulled, the output right; the blocks
    filed under them are never found by an honest request, whose output stays right."""
    ctx, gen = pair
    want_a, want_b = reference(ctx, A), reference(ctx, B)
    first = handoff(ctx, "c-garbage", A)
    garbage = rng.bytes(len(first.kv_handle.block_hashes))
    handle = KVHandle(**{**_fields(first.kv_handle), "block_hashes": garbage})
    add_request(gen, "g", PromptTokens.placeholder(len(A)), GREEDY,
                remote=RemotePrefill(handle, first.token_ids))
    assert tokens(drain(gen)) == want_a
    assert pulled(gen)[:2] == (12, 0)
    assert tokens(relay(ctx, gen, "honest", B)) == want_b
    assert pulled(gen)[:2] == (12 + 13, 0)               # nothing honest hit the garbage
    wait_for_release(ctx)


def test_tokens_pulled_with_the_kv_must_hash_to_the_hashes_sent(pair):
    """A request that reads its prompt gets the ids with its KV; hashes of another prompt
    beside them fail the request before its blocks are filed anywhere."""
    ctx, gen = pair
    other = handoff(ctx, "c-other", B).kv_handle.block_hashes[:len(A) // 4 * 16]
    first = handoff(ctx, "c-lie", A)
    handle = KVHandle(**{**_fields(first.kv_handle), "block_hashes": other})
    penalty = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3)
    add_request(gen, "lie", PromptTokens.placeholder(len(A)), penalty,
                remote=RemotePrefill(handle, first.token_ids))
    (delta,) = drain(gen)
    assert "block hashes are not its prompt's" in delta.error
    assert not gen.block_manager.cached
    for k in ("c-other", "c-lie"):
        ctx.remote_kv.leases.release(k, ctx.remote_kv.leases.leases[k].token)
    ctx.step()


def test_penalties_and_echo_of_a_length_only_prompt_equal_the_full_prompt(pair):
    ctx, gen = pair
    penalty = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3)
    want = reference(ctx, A, penalty)
    out = relay(ctx, gen, "pen", A, penalty)
    assert tokens(out) == want and out[0].prompt_bytes == b""
    out = relay(ctx, gen, "echo", B, prompt_back=True)
    assert np.array_equal(np.frombuffer(out[0].prompt_bytes, "<i4"), B.array)


def test_block_sizes_must_match(tiny_source):
    """A CTX and a GEN with different block sizes never exchange KV: the layout says so."""
    ctx, gen = engine(tiny_source), engine(tiny_source, block_size=8)
    try:
        first = handoff(ctx, "c-bs", A)
        with pytest.raises(InvalidRequestError, match="KV layout mismatch"):
            add_request(gen, "g", PromptTokens.placeholder(len(A)), GREEDY,
                        remote=RemotePrefill(first.kv_handle, first.token_ids))
    finally:
        ctx.remote_kv.close()
        gen.remote_kv.close()


def test_the_none_transport_fails_a_request_that_reads_its_prompt(tiny_source):
    cfg = EngineConfig(model="tiny-random", dtype="float32", seed=0, cache=CacheConfig(4, 64),
                       scheduler=SchedulerConfig(64, 8), kv=KVTransferConfig(backend="none"))
    ctx, gen = EngineCore(cfg, tiny_source), EngineCore(cfg, tiny_source)
    try:
        first = handoff(ctx, "c-none", A)
        penalty = SamplingParams(max_tokens=4, repetition_penalty=1.3)
        add_request(gen, "g", PromptTokens.placeholder(len(A)), penalty,
                    remote=RemotePrefill(first.kv_handle, first.token_ids))
        (delta,) = drain(gen)
        assert "brought no prompt token ids" in delta.error
    finally:
        ctx.remote_kv.close()
        gen.remote_kv.close()


def test_hashes_ride_only_a_length_only_relay():
    handle = KVHandle(backend="tcp", endpoint="tcp://h:1", ctx_request_id="r", layout="L",
                      num_tokens=8, block_hashes=bytes(32))
    assert relayed_handle(handle, "metadata") is handle
    for relay_mode in ("list", "b64"):
        assert relayed_handle(handle, relay_mode).block_hashes == b""


def _fields(handle: KVHandle) -> dict:
    return {f: getattr(handle, f) for f in handle.__struct_fields__}
