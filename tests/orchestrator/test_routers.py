"""Every router's choice, the request info they read, and the KV index they score with."""

import base64

import numpy as np
import pytest

from splitserve.errors import InvalidRequestError
from splitserve.orchestrator.cluster import Server
from splitserve.orchestrator.decide import MAX_SESSION_CHARS, session_id
from splitserve.orchestrator.kv_index import Held, KVIndex, parse_report
from splitserve.orchestrator.prompt_tokens import block_hashes
from splitserve.orchestrator.routers import (
    ROUTERS, KVAware, LeastLoaded, PrefixAware, RequestInfo, RoundRobin, SessionAffinity,
    make_router, rendezvous, route)
from splitserve.protocol.block_hashes import chain_hashes

BS = 4


def servers(n=4):
    return [Server(f"http://w{i}:8000") for i in range(n)]


def test_round_robin_takes_turns():
    s, rr = servers(3), RoundRobin()
    assert [rr.pick(s, RequestInfo()).url for _ in range(6)] == [x.url for x in s * 2]


def test_least_loaded_picks_the_idlest():
    s = servers(3)
    s[0].in_flight, s[1].in_flight, s[2].in_flight = 3, 1, 2
    assert LeastLoaded().pick(s, RequestInfo()) is s[1]


def test_prefix_aware_is_stable_and_moves_only_the_leavers_keys():
    s, router = servers(4), PrefixAware()
    keys = [f"prompt {i}".encode() for i in range(200)]
    before = {k: router.pick(s, RequestInfo(key=k)).url for k in keys}
    assert len(set(before.values())) == 4
    left = s[1:]
    after = {k: router.pick(left, RequestInfo(key=k)).url for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != s[0].url)


def test_session_affinity_keeps_a_session_and_moves_only_a_leavers_sessions():
    s, router = servers(4), SessionAffinity()
    sessions = [f"user-{i}" for i in range(200)]
    first = {u: router.pick(s, RequestInfo(session=u)).url for u in sessions}
    assert len(set(first.values())) == 4
    # the same session, whatever its prompt or the servers' loads
    s[0].in_flight = 50
    assert all(router.pick(s, RequestInfo(key=b"other", session=u)).url == first[u]
               for u in sessions)
    gone = s[2]
    after = {u: router.pick([x for x in s if x is not gone], RequestInfo(session=u)).url
             for u in sessions}
    moved = {u for u in sessions if after[u] != first[u]}
    assert moved == {u for u in sessions if first[u] == gone.url}


def test_session_affinity_without_a_session_uses_its_inner_router():
    s = servers(3)
    s[0].in_flight, s[1].in_flight = 2, 2
    assert SessionAffinity().pick(s, RequestInfo()) is s[2]      # least loaded by default
    rr = ROUTERS["session_affinity+round_robin"]()
    assert [rr.pick(s, RequestInfo()).url for _ in range(3)] == [x.url for x in s]


def test_every_router_has_a_name_and_a_session_layer():
    for name in ("round_robin", "least_loaded", "prefix_aware", "kv_aware"):
        assert isinstance(make_router(name), ROUTERS[name])
        assert isinstance(make_router("session_affinity+" + name), SessionAffinity)


def test_a_pinned_request_goes_to_its_server_while_it_is_a_candidate():
    s = servers(3)
    info = RequestInfo(key=b"k", pin=s[2].url)
    assert route(PrefixAware(), s, info) is s[2]
    assert route(PrefixAware(), s[:2], info) is rendezvous(s[:2], b"k")


# -- KV-aware ----------------------------------------------------------------------------
def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(3, 1000, n).astype(np.int32)


def index_holding(held: dict[str, np.ndarray]) -> KVIndex:
    """An index where each url caches the reusable blocks of the given tokens."""
    index = KVIndex()
    for url, ids in held.items():
        index.held[url] = Held("v1", BS, frozenset(block_hashes(ids, [BS])[BS]))
    return index


def kv_info(ids, index, key=b"k"):
    return RequestInfo(key=key, num_tokens=len(ids), hashes=block_hashes(ids, [BS]),
                       index=index)


def test_kv_index_counts_the_leading_blocks_held():
    ids = prompt(41)
    index = index_holding({"a": ids[:21], "b": ids})
    hashes = block_hashes(ids, [BS])
    assert index.cached_tokens("a", hashes) == 20     # 5 blocks; the 21st token is computed
    assert index.cached_tokens("b", hashes) == 40     # all but the last token's block
    assert index.cached_tokens("c", hashes) == 0
    assert index.cached_tokens("a", {16: hashes[BS]}) == 0   # another block size: no hit
    # a hole in the chain ends the prefix
    index.held["a"] = Held("v2", BS, frozenset(hashes[BS][1:]))
    assert index.cached_tokens("a", hashes) == 0


def test_kv_aware_picks_the_holder_over_the_prefix_choice():
    s, ids = servers(3), prompt(200)
    natural = rendezvous(s, b"k")
    holder = next(x for x in s if x is not natural)
    info = kv_info(ids, index_holding({holder.url: ids[:150]}))
    assert KVAware().pick(s, info) is holder


def test_kv_aware_weighs_the_hit_against_load():
    s, ids = servers(2), prompt(200)
    index = index_holding({s[0].url: ids})              # s[0] lacks 4 tokens, s[1] all 200
    info = kv_info(ids, index)
    s[0].in_flight = 0
    assert KVAware().pick(s, info) is s[0]
    s[0].in_flight = 1          # a whole prompt's wait: 4 + 200 > 200
    assert KVAware().pick(s, info) is s[1]
    s[1].in_flight = 1
    assert KVAware().pick(s, info) is s[0]


def test_kv_aware_without_counts_routes_by_prefix():
    s = servers(3)
    assert KVAware().pick(s, RequestInfo(key=b"abc")) is rendezvous(s, b"abc")
    info = kv_info(prompt(50), KVIndex(), key=b"xyz")   # nobody holds anything: a tie
    assert KVAware().pick(s, info) is rendezvous(s, b"xyz")


def test_parse_report_takes_well_formed_reports_only():
    hashes = chain_hashes(b"", prompt(16), BS)
    body = {"version": "ab-3", "block_size": BS, "total": 4,
            "hashes": base64.b64encode(b"".join(hashes)).decode()}
    assert parse_report(body) == Held("ab-3", BS, frozenset(hashes))
    assert parse_report({"version": "ab-3", "unchanged": True}) is None
    for bad in ({**body, "hashes": "!!"}, {**body, "hashes": base64.b64encode(b"x" * 17).decode()},
                {**body, "block_size": "4"}, [], None):
        assert parse_report(bad) is None


# -- the session id ----------------------------------------------------------------------
def header_of(headers):
    return lambda name: headers.get(name)


def test_session_id_is_the_header_else_the_user_field():
    assert session_id(header_of({"X-Session-Id": "s1"}), {"user": "u1"}) == "s1"
    assert session_id(header_of({}), {"user": "u1"}) == "u1"
    assert session_id(header_of({}), {}) is None


@pytest.mark.parametrize("headers, body, param", [
    ({"X-Session-Id": "x" * (MAX_SESSION_CHARS + 1)}, {}, "X-Session-Id"),
    ({}, {"user": "x" * (MAX_SESSION_CHARS + 1)}, "user"),
    ({}, {"user": 12}, "user")])
def test_session_id_is_bounded_where_it_is_read(headers, body, param):
    with pytest.raises(InvalidRequestError) as exc:
        session_id(header_of(headers), body)
    assert exc.value.param == param
