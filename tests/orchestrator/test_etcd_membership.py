"""Membership in etcd, in this process: the setting's URL, a member's signed record (only
the cluster's secret makes one a reader takes), and the orchestrator's view of the prefix
as watch events arrive. The real etcd server is tests/e2e/test_etcd_membership_e2e.py's."""

import asyncio
import base64
import logging

import orjson
import pytest

from splitserve.etcd import Event, prefix_end
from splitserve.metrics import Registry
from splitserve.orchestrator.cluster import ClusterConfig
from splitserve.orchestrator.etcd_membership import EtcdMembers, EtcdMembership
from splitserve.protocol.membership import (
    MAX_VALUE_BYTES, MemberRecord, parse_target, read, sign)
from splitserve.server.config import ServerConfig
from splitserve.trust import Keys

SECRET = "etcd-test-secret-0123456789abcdef"
KEYS = Keys(SECRET)
TARGET = parse_target("etcd://127.0.0.1:2379/cluster-a?ttl=2")


def record(url="http://10.0.0.1:8001", role="context") -> MemberRecord:
    return MemberRecord(role, url, "tcp://10.0.0.1:9001", "tiny-random", "tiny|float32|block=4")


def put(rec: MemberRecord, keys: Keys = KEYS) -> Event:
    key = TARGET.key(rec.url)
    return Event(key, sign(rec, key, keys))


# -- the setting ------------------------------------------------------------------------
def test_target_parses_endpoint_prefix_and_ttl():
    assert TARGET.endpoint == "http://127.0.0.1:2379"
    assert TARGET.prefix == "/cluster-a" and TARGET.ttl == 2.0
    assert TARGET.key("http://h:1") == "/cluster-a/workers/http://h:1"
    default = parse_target("etcd://[::1]:2379/a/b/")
    assert default.endpoint == "http://[::1]:2379" and default.prefix == "/a/b"
    assert default.ttl == 10.0


@pytest.mark.parametrize("value, says", [
    ("http://127.0.0.1:2379/p", "etcd://host:port/prefix"),
    ("etcd://127.0.0.1/p", "etcd://host:port/prefix"),
    ("etcd://127.0.0.1:99999/p", "etcd://host:port/prefix"),
    ("etcd://127.0.0.1:2379", "needs a key prefix"),
    ("etcd://127.0.0.1:2379/", "needs a key prefix"),
    ("etcd://127.0.0.1:2379/p?ttl=0.5", "ttl must be 1 to 3600"),
    ("etcd://127.0.0.1:2379/p?ttl=soon", "ttl must be"),
    ("etcd://127.0.0.1:2379/p?lease=3", "only ?ttl"),
])
def test_bad_targets_are_refused_naming_the_problem(value, says):
    with pytest.raises(ValueError, match=says.replace("?", r"\?")):
        parse_target(value)


def test_the_settings_are_checked_where_they_are_given():
    with pytest.raises(ValueError, match="etcd://host:port/prefix"):
        ClusterConfig.from_dict({"membership": "etcd://h/p"})
    # the static pools may be left out: the members are etcd's
    good = ClusterConfig.from_dict({"membership": "etcd://h:2379/p"})
    assert good.membership == "etcd://h:2379/p" and good.context_servers.urls == ()
    with pytest.raises(ValueError, match="missing context_servers"):
        ClusterConfig.from_dict({})
    with pytest.raises(ValueError, match="internal secret"):
        ServerConfig(membership="etcd://h:2379/p")
    with pytest.raises(ValueError, match="give one"):
        ServerConfig(membership="etcd://h:2379/p", register="http://o:8000",
                     internal_secret=SECRET)
    assert ServerConfig(membership="etcd://h:2379/p", internal_secret=SECRET).membership


# -- the record and its MAC -------------------------------------------------------------
def test_a_signed_record_reads_back_under_the_same_secret_and_key():
    event = put(record())
    assert read(event.key, event.value, KEYS) == record()


def test_a_record_is_refused_when_anything_differs():
    event = put(record())
    signed = orjson.loads(event.value)
    signed["record"]["url"] = "http://10.6.6.6:8001"     # pointed at another machine
    forged = orjson.dumps(signed)
    assert read(event.key, forged, KEYS) is None
    assert read(TARGET.key("http://10.0.0.2:8001"), event.value, KEYS) is None   # moved
    assert read(event.key, event.value, Keys("another-secret-0123456789abcdef")) is None
    unsigned = orjson.dumps({"record": signed["record"], "mac": ""})
    assert read(event.key, unsigned, KEYS) is None
    assert read(event.key, b"not json", KEYS) is None
    assert read(event.key, b'{"record": {}, "mac": "00"}', KEYS) is None
    assert read(event.key, b" " * (MAX_VALUE_BYTES + 1), KEYS) is None


def test_prefix_end_covers_exactly_the_prefix():
    assert base64.b64decode(prefix_end("/a/workers/")) == b"/a/workers0"
    assert base64.b64decode(prefix_end("a\xff")) == "a".encode() + b"\xc3\xc0"


# -- the orchestrator's view ------------------------------------------------------------
def test_members_join_leave_and_a_bad_record_is_logged_once(caplog):
    members = EtcdMembers(KEYS)
    ctx, gen = record(), record("http://10.0.0.2:8002", "generation")
    assert members.apply([put(ctx), put(gen)])
    assert {m["url"]: m["role"] for m in members.listing()} == {
        ctx.url: "context", gen.url: "generation"}
    assert members.listing()[0]["kv_endpoint"] == "tcp://10.0.0.1:9001"
    assert not members.apply([put(ctx)])      # a renewed put changes nothing

    rogue = put(record("http://10.6.6.6:8003"), Keys("another-secret-0123456789abcdef"))
    with caplog.at_level(logging.WARNING, "splitserve.orchestrator.etcd_membership"):
        assert not members.apply([rogue])
        assert not members.apply([rogue])
    assert [r.getMessage() for r in caplog.records].count(
        f"orch: etcd key {rogue.key} holds no record signed with this cluster's internal "
        f"secret; it is not a member") == 1
    assert len(members.listing()) == 2

    # a bad record written over a good one: the key no longer names a member
    assert members.apply([Event(TARGET.key(gen.url), b"{}")])
    assert [m["url"] for m in members.listing()] == [ctx.url]
    assert members.apply([Event(TARGET.key(ctx.url), None)])     # deleted or lapsed
    assert members.listing() == []


def test_a_read_of_the_whole_prefix_replaces_what_was_known():
    members = EtcdMembers(KEYS)
    a, b = record("http://10.0.0.1:1"), record("http://10.0.0.1:2")
    members.apply([put(a), put(b)])
    assert members.reset([put(b)])             # a left while the watch was down
    assert [m["url"] for m in members.listing()] == [b.url]
    assert not members.reset([put(b)])


def test_the_backend_lists_members_refuses_joins_and_reports_etcd_down():
    registry = Registry()
    membership = EtcdMembership(TARGET, KEYS, registry)
    heard = []
    membership.listeners.append(lambda: heard.append(membership.listing()))
    membership._changed(membership.current.apply([put(record())]))
    assert heard == [[{"role": "context", "url": record().url, "kv_endpoint":
                       "tcp://10.0.0.1:9001", "model": "tiny-random",
                       "layout": "tiny|float32|block=4"}]]
    status, body = asyncio.run(membership.call("GET", "/internal/workers", b""))
    assert status == 200 and orjson.loads(body)["data"] == heard[0]
    status, body = asyncio.run(membership.call("POST", "/internal/workers", b"{}"))
    assert status == 409 and "--membership etcd://" in orjson.loads(body)["error"]["message"]
    status, body = asyncio.run(membership.call("POST", "/internal/workers/role", b"{}"))
    assert status == 409 and "cannot move it" in orjson.loads(body)["error"]["message"]

    health = membership.health()
    assert health["connected"] is False and health["problem"] == "not read yet"
    assert "splitserve_orchestrator_membership_members 1" in registry.render().decode()
    membership._up()
    assert "splitserve_orchestrator_membership_connected 1" in registry.render().decode()
    assert membership.health() == {"backend": "etcd", "endpoint": TARGET.endpoint,
                                   "prefix": "/cluster-a", "connected": True, "members": 1}
    membership._down("etcd at http://127.0.0.1:2379 did not answer")
    health = membership.health()
    assert health["connected"] is False and health["members"] == 1
    assert "did not answer" in health["problem"] and health["unreachable_for_s"] >= 0
    assert "splitserve_orchestrator_membership_connected 0" in registry.render().decode()


def test_watch_messages_become_events_or_a_break():
    from splitserve.etcd import EtcdUnavailable, _watch_events
    key, value = base64.b64encode(b"/p/workers/u").decode(), base64.b64encode(b"v").decode()
    assert _watch_events(b'{"result":{"header":{"revision":"3"},"created":true}}') == []
    put_then_delete = orjson.dumps({"result": {"events": [
        {"kv": {"key": key, "value": value, "mod_revision": "4"}},
        {"type": "DELETE", "kv": {"key": key, "mod_revision": "5"}}]}})
    assert _watch_events(put_then_delete) == [Event("/p/workers/u", b"v"),
                                              Event("/p/workers/u", None)]
    for broken in (b'{"result":{"canceled":true,"cancel_reason":"gone"}}',
                   b'{"result":{"compact_revision":"9"}}', b"[]", b"not json",
                   b'{"result":{"events":[{"kv":{"key":"***"}}]}}'):
        with pytest.raises(EtcdUnavailable):
            _watch_events(broken)


def test_a_member_of_another_kv_layout_is_said(caplog):
    members = EtcdMembers(KEYS)
    other = MemberRecord("generation", "http://10.0.0.3:8003", "tcp://10.0.0.3:9003",
                         "tiny-random", "tiny|bfloat16|block=4")
    with caplog.at_level(logging.WARNING, "splitserve.orchestrator.etcd_membership"):
        members.apply([put(record()), put(record("http://10.0.0.2:8002", "generation"))])
        assert caplog.records == []
        members.apply([put(other)])
    assert [r.getMessage() for r in caplog.records] == [
        "orch: generation worker http://10.0.0.3:8003's KV layout [tiny|bfloat16|block=4] is "
        "not the other members' [tiny|float32|block=4]: KV cannot move between them"]
