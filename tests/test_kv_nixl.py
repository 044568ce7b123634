"""The nixl KV backend: the engine-level disaggregation tests over NIXL (UCX over TCP on
loopback), and the transport on its own with hand-built leases."""

import queue
import sys
import time

import numpy as np
import pytest
import torch

from splitserve.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from splitserve.engine.core import EngineCore
from splitserve.engine.request import FinishReason
from splitserve.kv.base import LeaseView, make_transport
from splitserve.kv.nixl import block_runs
from splitserve.protocol.engine import KVHandle, RemotePrefill
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens

from disagg_utils import GREEDY, PROMPT, drain, handoff, tokens
from disagg_utils import engine as _engine

# exc_type: a half-installed nixl (its __init__ raises ImportError) skips too.
nixl = pytest.importorskip("nixl", exc_type=ImportError,
                           reason="nixl is not importable: install torch first, then "
                                  "`pip install nixl==1.5.1` (scripts/install.sh test)")


def engine(source, timeout=5.0):
    return _engine(source, backend="nixl", timeout=timeout)


@pytest.fixture(scope="module")
def pair(tiny_source):
    ctx, gen = engine(tiny_source), engine(tiny_source)
    yield ctx, gen
    for e in (ctx, gen):
        e.remote_kv.close()


def test_disaggregated_greedy_equals_aggregated_and_frees_the_lease(pair):
    ctx, gen = pair
    ctx.add_request("agg", PROMPT, GREEDY)
    want = tokens(drain(ctx))
    first = handoff(ctx, "c1")
    assert first.kv_handle.backend == "nixl"
    assert ctx.remote_kv.num_leased_blocks == 6       # 23 tokens in blocks of 4
    gen.add_request("g1", PROMPT, GREEDY,
                    remote=RemotePrefill(first.kv_handle, first.token_ids, first.logprobs))
    out = drain(gen)
    assert tokens(out) == want and out[-1].finish_reason == FinishReason.LENGTH
    assert out[0].kv_transfer_time > 0
    deadline = time.monotonic() + 5
    while ctx.remote_kv.num_leased_blocks and time.monotonic() < deadline:
        ctx.step()   # applies GEN's ack once the serve thread has read it
        time.sleep(0.01)
    assert ctx.remote_kv.num_leased_blocks == 0
    for e in pair:
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


def test_pulled_kv_is_byte_identical(pair):
    ctx, gen = pair
    first = handoff(ctx, "c2")
    ctx_blocks = list(ctx.remote_kv.leases.leases["c2"].block_ids)
    ctx_kv = ctx.runner.kv_cache[ctx_blocks].clone()
    gen.add_request("g2", PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                    remote=RemotePrefill(first.kv_handle, first.token_ids))
    drain(gen, until=lambda d: len(d) >= 2)
    got = gen.runner.kv_cache[gen.groups["g2"][0].block_ids[:6]]
    # The last block holds 3 prompt tokens; later slots belong to generated tokens.
    assert torch.equal(got[:5], ctx_kv[:5])
    assert torch.equal(got[5, :, :, :3], ctx_kv[5, :, :, :3])
    gen.abort_request("g2")
    drain(gen)
    ctx.step()


def test_unknown_ctx_request_ends_that_request_only(pair):
    ctx, gen = pair
    forged = KVHandle(backend="nixl", endpoint=ctx.remote_kv.endpoint, ctx_request_id="nope",
                      layout=gen.remote_kv.layout, num_tokens=len(PROMPT))
    gen.add_request("g3", PROMPT, GREEDY, remote=RemotePrefill(forged, [5]))
    (delta,) = drain(gen)
    assert delta.finish_reason == FinishReason.ERROR and "unknown or expired" in delta.error
    assert gen.block_manager.num_free_blocks == gen.block_manager.num_blocks


def test_unreachable_context_worker_times_out_cleanly(tiny_source):
    gen = engine(tiny_source, timeout=0.5)
    try:
        dead = KVHandle(backend="nixl", endpoint="tcp://127.0.0.1:9", ctx_request_id="c",
                        layout=gen.remote_kv.layout, num_tokens=len(PROMPT))
        gen.add_request("g", PROMPT, GREEDY, remote=RemotePrefill(dead, [5]))
        (delta,) = drain(gen)
        assert delta.finish_reason == FinishReason.ERROR and "did not answer" in delta.error
        assert gen.block_manager.num_free_blocks == gen.block_manager.num_blocks
    finally:
        gen.remote_kv.close()


# -- the transport on its own ----------------------------------------------------------------

class Leases(LeaseView):
    def __init__(self, table):
        self.table, self.released = table, []

    def lookup(self, rid):
        return self.table.get(rid)

    def release(self, rid):
        self.released.append(rid)


@pytest.fixture(scope="module")
def transports():
    # (num_blocks, layers, 2, block_size, kv_heads, head_dim)
    src = torch.randn(16, 2, 2, 4, 2, 8)
    dst = torch.zeros_like(src)
    leases = Leases({"r": ([3, 4, 5, 9, 1], 20)})
    ctx, gen = make_transport("nixl", src, "L"), make_transport("nixl", dst, "L", timeout=5.0)
    ctx.start(leases)
    gen.start(Leases({}))
    yield ctx, gen, leases
    ctx.close()
    gen.close()


def pull(gen, handle, dst_blocks):
    results = queue.Queue()
    gen.pull(handle, dst_blocks, results.put)
    return results.get(timeout=10)


def test_pull_copies_scattered_blocks_and_acks(transports):
    ctx, gen, leases = transports
    handle = KVHandle(backend="nixl", endpoint=ctx.endpoint, ctx_request_id="r", layout="L",
                      num_tokens=20)
    result = pull(gen, handle, [7, 8, 0, 2, 15])
    assert result.ok, result.error
    assert result.nbytes == 5 * gen.block_bytes(0).numel() and result.seconds > 0
    assert torch.equal(gen.kv_cache[[7, 8, 0, 2, 15]], ctx.kv_cache[[3, 4, 5, 9, 1]])
    deadline = time.monotonic() + 5
    while not leases.released and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "r" in leases.released


@pytest.mark.parametrize("num_blocks, layout, error", [
    (4, "L", "expects 4 KV blocks but 'r' holds 5"),
    (5, "M", "KV layout mismatch"),
])
def test_lookup_errors_match_the_tcp_backend(transports, num_blocks, layout, error):
    ctx, gen, _ = transports
    handle = KVHandle(backend="nixl", endpoint=ctx.endpoint, ctx_request_id="r", layout=layout,
                      num_tokens=20)
    gen.layout = layout   # the GEN sends its own layout; this one is private to the test
    try:
        result = pull(gen, handle, list(range(num_blocks)))
    finally:
        gen.layout = "L"
    assert not result.ok and error in result.error


@pytest.mark.parametrize("state, error", [("ERR", "failed"), ("PROC", "did not finish within")])
def test_a_failed_read_ends_its_request_and_the_next_pull_reconnects(transports, monkeypatch,
                                                                     state, error):
    ctx, gen, _ = transports
    handle = KVHandle(backend="nixl", endpoint=ctx.endpoint, ctx_request_id="r", layout="L",
                      num_tokens=20)
    with monkeypatch.context() as patch:
        patch.setattr(gen, "timeout", 0.3)
        patch.setattr(gen.agent, "transfer", lambda xfer: "PROC")   # never posted: cancellable
        patch.setattr(gen.agent, "check_xfer_state", lambda xfer: state)
        result = pull(gen, handle, [0, 1, 2, 3, 4])
    assert not result.ok and error in result.error
    assert gen._remote == {}   # the CTX agent was dropped; the next pull loads it again
    gen.kv_cache.zero_()
    result = pull(gen, handle, [0, 1, 2, 3, 4])
    assert result.ok, result.error
    assert torch.equal(gen.kv_cache[:5], ctx.kv_cache[[3, 4, 5, 9, 1]])


def test_adjacent_blocks_share_one_descriptor():
    assert block_runs([3, 4, 5, 9, 1], [7, 8, 9, 2, 3]) == [(3, 7, 3), (9, 2, 1), (1, 3, 1)]
    assert block_runs([], []) == []


def test_missing_nixl_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)   # `import nixl` now raises ImportError
    with pytest.raises(ImportError, match="pip install nixl"):
        make_transport("nixl", torch.zeros(2, 1, 2, 4, 1, 8), "L")


def test_bad_ucx_settings_name_the_variables(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "no-such-transport")
    with pytest.raises(RuntimeError, match="UCX_TLS=no-such-transport"):
        make_transport("nixl", torch.zeros(2, 1, 2, 4, 1, 8), "L")
