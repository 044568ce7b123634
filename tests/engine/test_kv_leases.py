"""The lease table on its own: tokens, digests, and a request id leased twice."""

import numpy as np

from splitserve.engine.kv_leases import LeaseTable


def test_lookup_needs_the_token_and_the_digest_when_given():
    table = LeaseTable(lease_seconds=30.0)
    token = table.add("r", np.array([1, 2]), 20, digest="ab" * 16)
    assert table.lookup("r", "wrong") is None
    assert table.lookup("r", token, "cd" * 16) is None
    blocks, num_tokens = table.lookup("r", token, "ab" * 16)
    assert blocks.tolist() == [1, 2] and num_tokens == 20
    assert table.lookup("r", token) is not None     # a GEN that names no digest caches nothing


def test_a_request_id_leased_again_frees_the_first_lease():
    table = LeaseTable(lease_seconds=30.0)
    first = table.add("r", np.array([1, 2]), 20)
    second = table.add("r", np.array([3]), 4)
    assert table.lookup("r", first) is None
    assert [b.tolist() for b in table.collect()] == [[1, 2]]
    assert table.num_leased_blocks == 1
    assert not table.release("r", first) and table.release("r", second)
    assert [b.tolist() for b in table.collect()] == [[3]]
