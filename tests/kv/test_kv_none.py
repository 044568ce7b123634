"""The `none` KV transport: chosen by name like the others, it moves no bytes."""

import numpy as np
import pytest
import torch

from splitserve.config import KVTransferConfig
from splitserve.kv.base import make_transport
from splitserve.protocol.engine import KVHandle


def test_a_pull_succeeds_at_once_and_leaves_the_blocks_as_they_were():
    cache = torch.arange(4 * 2 * 2 * 4 * 1 * 8, dtype=torch.float32).view(4, 2, 2, 4, 1, 8)
    before = cache.clone()
    transport = make_transport("none", cache, "L", host="127.0.0.1", timeout=1.0)
    assert transport.name == "none" and transport.start(None) == "tcp://127.0.0.1:0"
    handle = KVHandle(backend="none", endpoint="tcp://127.0.0.1:1", ctx_request_id="r",
                      layout="L", num_tokens=8)
    results = []
    transport.pull(handle, np.array([2, 3]), results.append)
    assert [(r.ok, r.nbytes) for r in results] == [(True, 0)]
    assert torch.equal(cache, before) and transport.health() is None
    transport.close()


def test_the_backend_is_checked_against_the_known_transports():
    assert KVTransferConfig(backend="none").backend == "none"
    with pytest.raises(ValueError, match="tcp, nixl, none, got 'skip'"):
        KVTransferConfig(backend="skip")
    with pytest.raises(ValueError, match="unknown KV transport 'skip'; known: tcp, nixl, none"):
        make_transport("skip", torch.zeros(2, 1, 2, 4, 1, 8), "L")
