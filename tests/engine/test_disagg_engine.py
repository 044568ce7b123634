"""Context-only and generation-only requests across two in-process engines, KV over each
backend (nixl's tests skip when it is not importable)."""

import time

import numpy as np
import pytest
import torch

from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.engine.core import EngineCore
from splitserve.engine.request import FinishReason
from splitserve.errors import InvalidRequestError
from splitserve.protocol.engine import KVHandle, RemotePrefill
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens

from disagg_utils import (BACKENDS, GREEDY, PROMPT, digest, drain, engine, handoff,
                          require_backend, tokens, wait_for_release)
from engine_requests import add_request


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    require_backend(request.param)
    return request.param


@pytest.fixture(scope="module")
def pair(tiny_source, backend):
    ctx, gen = engine(tiny_source, backend), engine(tiny_source, backend)
    yield ctx, gen
    for e in (ctx, gen):
        e.remote_kv.close()


def test_disaggregated_greedy_equals_aggregated_and_frees_the_lease(pair, backend):
    ctx, gen = pair
    add_request(ctx, "agg", PROMPT, GREEDY)
    want = tokens(drain(ctx))
    first = handoff(ctx, "c1")
    assert first.token_ids == want[:1] and first.kv_handle.backend == backend
    assert ctx.remote_kv.num_leased_blocks == 6       # 23 tokens in blocks of 4
    add_request(gen, "g1", PROMPT, GREEDY,
                    remote=RemotePrefill(first.kv_handle, first.token_ids, first.logprobs))
    out = drain(gen)
    assert tokens(out) == want and out[-1].finish_reason == FinishReason.LENGTH
    assert out[0].kv_transfer_time > 0
    wait_for_release(ctx)
    assert ctx.remote_kv.num_leased_blocks == 0
    for e in pair:
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


def test_pulled_kv_is_byte_identical(pair):
    ctx, gen = pair
    first = handoff(ctx, "c2")
    ctx_blocks = list(ctx.remote_kv.leases.leases["c2"].block_ids)
    ctx_kv = ctx.runner.kv_cache[ctx_blocks].clone()
    add_request(gen, "g2", PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                    remote=RemotePrefill(first.kv_handle, first.token_ids))
    drain(gen, until=lambda d: len(d) >= 2)
    req = gen.groups["g2"][0]
    got = gen.runner.kv_cache[req.block_ids[:6]]
    # The last block holds 3 prompt tokens; later slots belong to generated tokens.
    assert torch.equal(got[:5], ctx_kv[:5])
    assert torch.equal(got[5, :, :, :3], ctx_kv[5, :, :, :3])
    gen.abort_request("g2")
    drain(gen)
    ctx.step()


def test_unknown_ctx_request_and_layout_mismatch(pair, backend):
    ctx, gen = pair
    forged = KVHandle(backend=backend, endpoint=ctx.remote_kv.endpoint, ctx_request_id="nope",
                      layout=gen.remote_kv.layout, num_tokens=len(PROMPT),
                      prompt_digest=digest())
    add_request(gen, "g3", PROMPT, GREEDY, remote=RemotePrefill(forged, [5]))
    (delta,) = drain(gen)
    assert delta.finish_reason == FinishReason.ERROR and "unknown or expired" in delta.error
    bad_layout = KVHandle(backend=backend, endpoint=ctx.remote_kv.endpoint, ctx_request_id="x",
                          layout="other-model|float32", num_tokens=len(PROMPT))
    with pytest.raises(InvalidRequestError, match="layout mismatch"):
        add_request(gen, "g4", PROMPT, GREEDY, remote=RemotePrefill(bad_layout, [5]))
    with pytest.raises(InvalidRequestError) as err:
        add_request(gen, "g5", PromptTokens(PROMPT.array[:10]), GREEDY,
                        remote=RemotePrefill(forged, [5]))
    assert err.value.param == "disaggregated_params.prompt_len"
    assert gen.block_manager.num_free_blocks == gen.block_manager.num_blocks


def test_unreachable_context_worker_fails_its_request_cleanly(tiny_source, backend):
    gen = engine(tiny_source, backend)
    try:
        dead = KVHandle(backend=backend, endpoint="tcp://127.0.0.1:9", ctx_request_id="c",
                        layout=gen.remote_kv.layout, num_tokens=len(PROMPT),
                        prompt_digest=digest())
        add_request(gen, "g", PROMPT, GREEDY, remote=RemotePrefill(dead, [5]))
        (delta,) = drain(gen)
        assert delta.finish_reason == FinishReason.ERROR and "could not connect" in delta.error
        assert gen.block_manager.num_free_blocks == gen.block_manager.num_blocks
    finally:
        gen.remote_kv.close()


def test_lease_expires_when_no_generation_worker_comes(tiny_source):
    ctx = engine(tiny_source, lease=0.2)
    try:
        handoff(ctx, "c")
        assert ctx.remote_kv.num_leased_blocks > 0
        time.sleep(0.3)
        ctx.step()
        assert ctx.remote_kv.num_leased_blocks == 0
        assert ctx.block_manager.num_free_blocks == ctx.block_manager.num_blocks
    finally:
        ctx.remote_kv.close()


def test_context_only_that_finishes_early_leases_nothing(pair):
    ctx, _ = pair
    add_request(ctx, "c6", PROMPT, SamplingParams(temperature=0, max_tokens=1), context_only=True)
    (delta,) = drain(ctx)
    assert delta.finish_reason == FinishReason.LENGTH and delta.kv_handle is None
    assert ctx.remote_kv.num_leased_blocks == 0


def test_length_only_prompt_decodes_identically(pair):
    ctx, gen = pair
    add_request(ctx, "agg-p", PROMPT, GREEDY)
    want = tokens(drain(ctx))
    first = handoff(ctx, "c7")
    add_request(gen, "g7", PromptTokens.placeholder(len(PROMPT)), GREEDY,
                    remote=RemotePrefill(first.kv_handle, first.token_ids))
    assert tokens(drain(gen)) == want
    ctx.step()


def test_length_only_prompt_refuses_prompt_logprobs(pair):
    """Prompt logprobs need the prompt computed here; what else reads the prompt's values
    gets them with the KV (test_prompt_over_kv.py)."""
    ctx, gen = pair
    first = handoff(ctx, "c8")
    remote = RemotePrefill(first.kv_handle, first.token_ids)
    for params, param in [(SamplingParams(prompt_logprobs=1), "prompt_logprobs")]:
        with pytest.raises(InvalidRequestError) as err:
            add_request(gen, "g8", PromptTokens.placeholder(len(PROMPT)), params, remote=remote)
        assert err.value.param == param
    add_request(gen, "g8", PromptTokens.placeholder(len(PROMPT)), GREEDY, remote=remote)
    drain(gen)
    ctx.step()


def test_length_only_requests_are_never_preempted(tiny_source):
    """Blocks run out while length-only requests decode: the recomputable request is
    preempted (and finishes later exactly), the length-only ones are not."""
    ctx = engine(tiny_source)
    cfg = EngineConfig(model="tiny-random", dtype="float32", seed=0,
                       cache=CacheConfig(4, 20, enable_prefix_caching=False),
                       scheduler=SchedulerConfig(64, 8))
    gen = EngineCore(cfg, tiny_source)
    try:
        long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        add_request(ctx, "ref", PROMPT, long)
        want = tokens(drain(ctx))
        firsts = [handoff(ctx, f"c{i}", params=long) for i in range(2)]
        for i, f in enumerate(firsts):
            add_request(gen, f"g{i}", PromptTokens.placeholder(len(PROMPT)), long,
                            remote=RemotePrefill(f.kv_handle, f.token_ids))
        add_request(gen, "local", PROMPT, long)
        preempted = []
        orig = gen.scheduler._preempt
        gen.scheduler._preempt = lambda r: (preempted.append(r.request_id), orig(r))
        out = drain(gen)
        by_id = {rid: [t for d in out if d.request_id == rid for t in d.token_ids]
                 for rid in ("g0", "g1", "local")}
        assert preempted and set(preempted) == {"local"}
        finished = [d for d in out if d.finish_reason is not None]
        assert all(d.finish_reason in (FinishReason.LENGTH, FinishReason.ERROR) for d in finished)
        for rid, toks in by_id.items():
            if len(toks) == 24:
                assert toks == want
        assert gen.block_manager.num_free_blocks == gen.block_manager.num_blocks
    finally:
        ctx.remote_kv.close()
        gen.remote_kv.close()


def test_kv_pulls_start_while_decodes_use_the_whole_token_budget(tiny_source):
    """A pull needs blocks, not compute: a generation_only request is admitted even when
    the running decodes take every token of the step's budget."""
    ctx = engine(tiny_source)
    gen = EngineCore(EngineConfig(model="tiny-random", dtype="float32", seed=0,
                                  cache=CacheConfig(4, 256), scheduler=SchedulerConfig(4, 8)),
                     tiny_source)
    try:
        add_request(ctx, "ref", PROMPT, GREEDY)
        want = tokens(drain(ctx))
        first = handoff(ctx, "c1")
        busy = SamplingParams(max_tokens=60, ignore_eos=True)
        for i in range(4):   # one-token prompts: 4 decodes fill a budget of 4
            add_request(gen, f"local{i}", PromptTokens(np.array([7 + i], np.int32)), busy)
        for _ in range(3):
            gen.step()
        add_request(gen, "g", PROMPT, GREEDY,
                        remote=RemotePrefill(first.kv_handle, first.token_ids, first.logprobs))
        out = gen.step()
        assert not gen.scheduler.waiting                # pulled, though no budget was left
        assert len(gen.scheduler.running) == 4
        out += drain(gen)
        assert tokens([d for d in out if d.request_id == "g"]) == want
        assert gen.block_manager.num_free_blocks == gen.block_manager.num_blocks
    finally:
        ctx.remote_kv.close()
        gen.remote_kv.close()


def test_kv_health_names_the_stopped_transport_threads(tiny_source):
    e = engine(tiny_source, "tcp")
    assert e.remote_kv.health() is None
    e.remote_kv.close()
    problem = e.remote_kv.health()
    assert problem is not None and "kv-tcp-serve" in problem and "kv-tcp-pull" in problem
