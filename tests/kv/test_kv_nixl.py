"""The nixl KV transport on its own, with hand-built leases (the engine-level tests over
both backends are in test_disagg_engine.py)."""

import queue
import sys
import time

import numpy as np
import pytest
import torch

from splitserve.engine.kv_leases import LeaseTable
from splitserve.kv.base import LeaseView, make_transport
import splitserve.kv.nixl as nixl_module
from splitserve.kv.nixl import _descs, block_runs
from splitserve.protocol.engine import KVHandle

from disagg_utils import require_backend

require_backend("nixl")

TOKEN = "lease-token"


class Leases(LeaseView):
    """Hand-built leases: each begins when a transport watches, ends on end(); every
    watcher hears of both, as the engine's lease table tells them all."""

    def __init__(self, table):
        self.table, self.released, self.watchers = table, [], []

    def lookup(self, rid, token, digest=""):
        return self.table.get(rid) if token == TOKEN else None

    def release(self, rid, token):
        if token == TOKEN:
            self.released.append(rid)
        return token == TOKEN

    def watch(self, started, ended):
        for rid, (blocks, _) in self.table.items():
            started(rid, blocks)
        self.watchers.append(ended)

    def end(self, rid):
        for ended in self.watchers:
            ended(rid)


@pytest.fixture(scope="module")
def transports():
    # (num_blocks, layers, 2, block_size, kv_heads, head_dim)
    src = torch.randn(16, 2, 2, 4, 2, 8)
    dst = torch.zeros_like(src)
    leases = Leases({"r": (np.array([3, 4, 5, 9, 1]), 20)})
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
                      num_tokens=20, lease_token=TOKEN)
    result = pull(gen, handle, np.array([7, 8, 0, 2, 15]))
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
                      num_tokens=20, lease_token=TOKEN)
    gen.layout = layout   # the GEN sends its own layout; this one is private to the test
    try:
        result = pull(gen, handle, np.arange(num_blocks))
    finally:
        gen.layout = "L"
    assert not result.ok and error in result.error


@pytest.mark.parametrize("state, error", [("ERR", "failed"), ("PROC", "did not finish within")])
def test_a_failed_read_ends_its_request_and_the_next_pull_reconnects(transports, monkeypatch,
                                                                     state, error):
    ctx, gen, _ = transports
    handle = KVHandle(backend="nixl", endpoint=ctx.endpoint, ctx_request_id="r", layout="L",
                      num_tokens=20, lease_token=TOKEN)
    with monkeypatch.context() as patch:
        patch.setattr(gen, "timeout", 0.3)
        patch.setattr(gen.agent, "transfer", lambda xfer: "PROC")   # never posted: cancellable
        patch.setattr(gen.agent, "check_xfer_state", lambda xfer: state)
        result = pull(gen, handle, np.arange(5))
    assert not result.ok and error in result.error
    assert gen._remote == {}   # the CTX agent was dropped; the next pull loads it again
    gen.kv_cache.zero_()
    result = pull(gen, handle, np.arange(5))
    assert result.ok, result.error
    assert torch.equal(gen.kv_cache[:5], ctx.kv_cache[[3, 4, 5, 9, 1]])


def test_adjacent_blocks_share_one_descriptor():
    runs = block_runs(np.array([3, 4, 5, 9, 1]), np.array([7, 8, 9, 2, 3]))
    assert [r.tolist() for r in runs] == [[3, 9, 1], [7, 2, 3], [3, 1, 1]]
    assert [r.tolist() for r in block_runs(np.array([], np.int64), np.array([], np.int64))] == [[], [], []]


def test_missing_nixl_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)   # `import nixl` now raises ImportError
    with pytest.raises(ImportError, match="pip install nixl"):
        make_transport("nixl", torch.zeros(2, 1, 2, 4, 1, 8), "L")


def test_bad_ucx_settings_name_the_variables(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "no-such-transport")
    with pytest.raises(RuntimeError, match="UCX_TLS=no-such-transport"):
        make_transport("nixl", torch.zeros(2, 1, 2, 4, 1, 8), "L")


def read_directly(gen, ctx, ctx_blocks):
    """What a GEN could ask its own NIXL agent for, past what the CTX offered: a READ of
    ctx_blocks (one run) into its blocks 10 on."""
    n, bb = len(ctx_blocks), gen.block_nbytes
    local = gen.agent.get_xfer_descs(_descs(gen.kv_cache.data_ptr(), bb, np.array([10]),
                                            np.array([n])), "DRAM")
    far = gen.agent.get_xfer_descs(_descs(ctx.kv_cache.data_ptr(), bb,
                                          np.array([ctx_blocks[0]]), np.array([n])), "DRAM")
    xfer = gen.agent.initialize_xfer("READ", local, far, gen._remote[ctx.endpoint])
    xfer.release()


def test_a_gen_can_read_only_the_blocks_of_its_lease(transports):
    ctx, gen, _ = transports
    handle = KVHandle(backend="nixl", endpoint=ctx.endpoint, ctx_request_id="r", layout="L",
                      num_tokens=20, lease_token=TOKEN)
    assert pull(gen, handle, np.arange(5)).ok       # the GEN's agent knows the lease's regions
    read_directly(gen, ctx, [3, 4, 5])              # a run of the lease: allowed
    for outside in ([0], [2], [6], [5, 6], [15]):   # around and past the leased runs
        with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):
            read_directly(gen, ctx, outside)


def test_a_lease_is_exposed_only_until_it_ends(transports):
    src = transports[0].kv_cache
    leases = Leases({"e": (np.array([2, 7]), 8), "f": (np.array([11]), 4)})
    ctx = make_transport("nixl", src, "L")
    try:
        ctx.start(leases)
        assert set(ctx._leased) == {"e", "f"}
        leases.end("e")
        assert set(ctx._leased) == {"f"}
        gen = transports[1]
        handle = KVHandle(backend="nixl", endpoint=ctx.endpoint, ctx_request_id="e",
                          layout="L", num_tokens=8, lease_token=TOKEN)
        result = pull(gen, handle, np.arange(2))    # the table still answers; nixl does not
        assert not result.ok and "unknown or expired" in result.error
    finally:
        ctx.close()
    assert ctx._leased == {}


def test_a_gen_reconnects_after_loading_many_leases(transports, monkeypatch):
    ctx, gen, _ = transports
    monkeypatch.setattr(nixl_module, "MAX_LOADS_PER_AGENT", 2)
    handle = KVHandle(backend="nixl", endpoint=ctx.endpoint, ctx_request_id="r", layout="L",
                      num_tokens=20, lease_token=TOKEN)
    loads = []
    for _ in range(3):
        gen.kv_cache.zero_()
        result = pull(gen, handle, np.arange(5))
        assert result.ok, result.error
        assert torch.equal(gen.kv_cache[:5], ctx.kv_cache[[3, 4, 5, 9, 1]])
        loads.append(gen._loads[ctx.endpoint])
    assert loads[-1] == 1 and max(loads) == 2


def test_the_lease_table_registers_a_lease_until_its_ack_or_expiry(transports):
    table = LeaseTable(lease_seconds=30.0)
    ctx = make_transport("nixl", transports[0].kv_cache, "L")
    try:
        ctx.start(table)
        token = table.add("acked", np.array([1, 2]), 8)
        table.add("expires", np.array([6]), 4)
        assert set(ctx._leased) == {"acked", "expires"}
        assert table.release("acked", token)
        assert [b.tolist() for b in table.collect()] == [[1, 2]]
        assert set(ctx._leased) == {"expires"}
        assert [b.tolist() for b in table.collect(now=time.monotonic() + 31)] == [[6]]
        assert ctx._leased == {}
    finally:
        ctx.close()


def test_an_idle_agent_leaves_the_cpu_alone(transports):
    """NIXL's progress thread polls UCX every PROGRESS_DELAY_US: with nixl's default (no
    wait) two idle agents kept two CPUs busy, those a worker's engine runs on."""
    assert transports                       # a CTX's and a GEN's agent, both idle now
    start = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - start < 0.3
