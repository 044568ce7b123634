"""Shared pieces of the in-process disaggregation tests: two engines, KV over a backend."""

import time

import numpy as np
import pytest

from splitserve.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from splitserve.engine.core import EngineCore
from splitserve.engine.request import FinishReason
from splitserve.protocol.block_hashes import chain_hashes, prompt_digest
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens
from engine_requests import add_request

PROMPT = PromptTokens(np.random.default_rng(0).integers(3, 49152, 23).astype(np.int32))
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BACKENDS = ["tcp", "nixl"]


def digest(prompt=PROMPT, block_size=4) -> str:
    """The prompt digest a context worker puts in its KV handles, for hand-built handles."""
    return prompt_digest(prompt.array, block_size, chain_hashes(b"", prompt.array, block_size))


def require_backend(backend):
    """Skips the calling test, or a whole module at import, when the backend's optional
    package is not importable."""
    if backend == "nixl":
        # exc_type: a half-installed nixl (its __init__ raises ImportError) skips too.
        pytest.importorskip("nixl", exc_type=ImportError,
                            reason="nixl is not importable: install torch first, then "
                                   "`pip install nixl==1.5.1` (scripts/install.sh test)")


def engine(source, backend="tcp", lease=30.0, timeout=5.0, dtype="float32", block_size=4,
           prefix_caching=True, **kv_options):
    """kv_options: more KVTransferConfig fields (connect_timeout, idle_seconds, ...).
    prefix_caching=False: a GEN pulls every block of a prompt it has seen before too."""
    cfg = EngineConfig(model="tiny-random", dtype=dtype, seed=0,
                       cache=CacheConfig(block_size, 128, enable_prefix_caching=prefix_caching),
                       scheduler=SchedulerConfig(64, 8),
                       kv=KVTransferConfig(backend=backend, lease_seconds=lease, timeout=timeout,
                                           **kv_options))
    return EngineCore(cfg, source)


def serving(*engines):
    """A fixture's body (`yield from`): the engines, then their KV transports closed."""
    try:
        yield engines
    finally:
        for e in engines:
            e.remote_kv.close()


def drain(e, until=lambda deltas: False, timeout=20.0):
    deltas, deadline = [], time.monotonic() + timeout
    while e.has_unfinished_requests() or e.pending:
        deltas += e.step()
        if until(deltas):
            break
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return deltas


def wait_for_release(ctx, timeout=5.0):
    """Steps the CTX until GEN's ack has freed every lease (its serve thread reads the ack
    at its own pace)."""
    deadline = time.monotonic() + timeout
    while ctx.remote_kv.num_leased_blocks and time.monotonic() < deadline:
        ctx.step()
        time.sleep(0.01)


def tokens(deltas):
    return [t for d in deltas for t in d.token_ids]


def handoff(ctx, rid, prompt=PROMPT, params=GREEDY):
    add_request(ctx, rid, prompt, params, context_only=True)
    (delta,) = drain(ctx)
    assert delta.finish_reason == FinishReason.HANDOFF and delta.kv_handle is not None
    return delta
