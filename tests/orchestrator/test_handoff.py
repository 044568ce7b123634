"""A draining worker's handoff comment on hand-built SSE bytes: kept out of the client's
bytes at any chunk boundary, and turned into the generation_only continuation."""

import json

import msgspec
import pytest

from splitserve.orchestrator.migrate import Continuation, StreamTap, moved_body
from splitserve.protocol.disagg import DisaggregatedParams, handoff_comment
from splitserve.protocol.engine import KVHandle

HANDLE = KVHandle(backend="tcp", endpoint="tcp://127.0.0.1:5555", ctx_request_id="cmpl-1",
                  layout="L", num_tokens=25, lease_token="t", block_hashes=b"\x01" * 16)
PARAMS = DisaggregatedParams(request_type="generation_only", prompt_len=23,
                             ctx_request_id="cmpl-1", kv_handle=HANDLE, token_relay="metadata")


def event(text: str) -> bytes:
    return b"data: " + json.dumps({"id": "A", "created": 7, "choices": [
        {"index": 0, "text": text, "finish_reason": None}]}).encode() + b"\n\n"


STREAM = (b": ids 11\n\n" + event("a") + b": ids 12 13\n\n" + event("bc")
          + handoff_comment(PARAMS))


@pytest.mark.parametrize("size", [1, 5, 64, 10_000])
def test_the_handoff_comment_is_kept_and_never_reaches_the_client(size):
    tap, out = StreamTap(), b""
    tap.feed(STREAM[:len(b": ids 11\n\n") + len(event("a"))])   # the first event, held
    rest = STREAM[len(b": ids 11\n\n") + len(event("a")):]
    for i in range(0, len(rest), size):
        out += tap.feed(rest[i:i + size])
    assert out == event("bc")
    assert tap.token_ids == [11, 12, 13] and tap.migratable(max_tokens=16)
    assert tap.handoff["kv_handle"]["num_tokens"] == 25


def test_a_handoff_that_is_not_an_object_is_malformed():
    tap = StreamTap()
    tap.feed(event("a"))
    with pytest.raises(ValueError):
        tap.feed(b": handoff [1, 2]\n\n")


def test_moved_body_is_a_generation_only_continuation_the_worker_decodes():
    tap = StreamTap()
    tap.feed(STREAM)
    body = {"model": "m", "prompt": "hello", "max_tokens": 20, "stream": True,
            "token_relay": "b64", "seed": 3}
    out = moved_body(body, tap.token_ids, tap.handoff)
    assert "prompt" not in out and "token_relay" not in out and out["seed"] == 3
    dp = msgspec.json.decode(json.dumps(out["disaggregated_params"]), type=DisaggregatedParams)
    dp.check_generation_only()
    dp.check_resume()
    assert dp.resume_token_ids == [11, 12, 13] and dp.kv_handle == HANDLE
    assert dp.stream_token_ids and dp.first_gen_tokens is None
    assert body["prompt"] == "hello"     # the client's body is not changed


def test_a_continuation_handed_off_again_is_moved_by_its_kv_again():
    """The worker a stream was continued on drains too: the first stream's tap holds the
    second handoff, so the next continuation pulls that KV instead of recomputing."""
    tap = StreamTap()
    tap.feed(STREAM)
    tap.handoff = None                  # carry_on took the first handoff
    second = Continuation(tap)
    out = second.feed(b": ids 14\n\n" + event("d") + handoff_comment(PARAMS))
    assert b"handoff" not in out and tap.token_ids == [11, 12, 13, 14]
    assert tap.handoff["kv_handle"]["num_tokens"] == 25
