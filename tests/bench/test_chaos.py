"""`bench chaos`'s pure parts: schedules replay from (seed, k), the request pool covers the
mix, and each way a request can end is told apart from the bytes a server sent."""

import io
import json

from splitserve.bench.chaos.faults import (CLIENT_CUT, EXPIRY_MARGIN, SIGNALS, TARGETS,
                                           draw_schedule)
from splitserve.kv.faults import KINDS as KV_KINDS
from splitserve.bench.chaos.workload import _streamed, _whole, request_pool


def test_a_schedule_is_a_pure_function_of_seed_and_index():
    a, b = draw_schedule(7, 3, 16, 8, 2.0, 3), draw_schedule(7, 3, 16, 8, 2.0, 3)
    assert a == b
    assert a != draw_schedule(7, 4, 16, 8, 2.0, 3) and a != draw_schedule(8, 3, 16, 8, 2.0, 3)
    assert len(a.picks) == 8 and all(0 <= i < 16 for i in a.picks)
    assert a.starts == sorted(a.starts) and all(0 <= s <= 2.0 for s in a.starts)


def test_faults_cover_every_signal_and_target_over_a_campaign():
    kinds = {f.kind for k in range(200) for f in draw_schedule(0, k, 16, 8, 2.0, 3).faults}
    assert kinds == {f"{s}:{t}" for s in SIGNALS for t in TARGETS} | {CLIENT_CUT}
    for k in range(50):
        faults = draw_schedule(0, k, 16, 8, 2.0, 3).faults
        assert 1 <= len(faults) <= 3 and [f.at for f in faults] == sorted(f.at for f in faults)


def test_kv_faults_come_on_top_of_the_same_other_faults():
    for k in range(50):
        without = draw_schedule(3, k, 16, 8, 2.0, 3)
        with_kv = draw_schedule(3, k, 16, 8, 2.0, 3, most_kv_faults=2, lease=3.0)
        assert with_kv.picks == without.picks and with_kv.starts == without.starts
        assert [f for f in with_kv.faults if not f.is_kv] == without.faults
        kv = [f for f in with_kv.faults if f.is_kv]
        assert len(kv) <= 2 and all(0 <= f.at <= 2.0 for f in kv)
        assert [f.at for f in with_kv.faults] == sorted(f.at for f in with_kv.faults)
        for f in kv:   # an expiry waits past the lease; a delay 0.2-2 s; the others none
            want = {"kv_lease_expiry": (3.0 + EXPIRY_MARGIN,) * 2,
                    "kv_delay": (0.2, 2.0)}.get(f.kind, (0.0, 0.0))
            assert want[0] <= f.pause <= want[1], f
    kinds = {f.kind for k in range(200)
             for f in draw_schedule(0, k, 16, 8, 2.0, 3, 2).faults if f.is_kv}
    assert kinds == set(KV_KINDS)


def test_the_pool_mixes_every_kind_of_request():
    pool = request_pool(5)
    assert pool == request_pool(5) and pool != request_pool(6)
    assert {b["stream"] for b in pool} == {True, False}
    assert {b["n"] for b in pool} == {1, 2}
    assert {"seed" in b for b in pool} == {True, False}
    assert {"messages" in b for b in pool} == {True, False}
    prompts = [b.get("prompt") or b["messages"][0]["content"] for b in pool]
    shared = [p for p in prompts if len(p.split()) > 300]
    assert len(shared) >= 2 and len({p.split()[:300] == shared[0].split()[:300]
                                     for p in shared}) == 1


def sse(*events) -> io.BytesIO:
    return io.BytesIO(b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode())
                               + b"\n\n" for e in events))


def chunk(index, text):
    return {"choices": [{"index": index, "text": text}]}


def test_streams_end_in_text_a_clear_error_or_broken():
    out = _streamed(sse(chunk(1, "b"), chunk(0, "a"), chunk(0, "c"), b"[DONE]"))
    assert (out.kind, out.texts) == ("text", ["ac", "b"])
    out = _streamed(sse(chunk(0, "a"), {"error": {"message": "worker stopped"}}, b"[DONE]"))
    assert (out.kind, out.detail) == ("error", "worker stopped")
    assert _streamed(sse(chunk(0, "a"))).kind == "broken"
    assert _streamed(sse(chunk(0, "a"), {"error": {"message": "x"}})).kind == "broken"


def test_whole_answers_end_in_text_a_clear_error_or_broken():
    body = {"choices": [{"index": 1, "message": {"content": "y"}},
                        {"index": 0, "message": {"content": "x"}}]}
    out = _whole(200, json.dumps(body).encode())
    assert (out.kind, out.texts) == ("text", ["x", "y"])
    out = _whole(503, json.dumps({"error": {"message": "no generation worker"}}).encode())
    assert (out.kind, out.detail) == ("error", "HTTP 503: no generation worker")
    assert _whole(502, b"<html>bad gateway</html>").kind == "broken"
    assert _whole(500, b'{"detail": "oops"}').kind == "broken"
