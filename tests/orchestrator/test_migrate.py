"""orchestrator/migrate.py on hand-built SSE bytes: ids stripped and kept whatever the chunk
boundaries, and a continuation rewritten into the first stream's shape."""

import json

import pytest

from splitserve.orchestrator.migrate import Continuation, StreamTap, max_tokens, resume_body


def event(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def chunk(rid, content=None, finish=None, role=False):
    delta = {"role": "assistant", "content": ""} if role else {"content": content}
    return event({"id": rid, "object": "chat.completion.chunk", "created": 7, "model": "m",
                  "choices": [{"index": 0, "delta": delta, "logprobs": None,
                               "finish_reason": finish}]})


FIRST = (b": ids 11\n\n" + chunk("A", role=True) + chunk("A", "Hel") + b": ids 12 13\n\n"
         + chunk("A", "lo"))


@pytest.mark.parametrize("size", [1, 3, 7, 10_000])
def test_tap_strips_ids_at_any_chunk_boundary(size):
    tap, out = StreamTap(), b""
    for i in range(0, len(FIRST), size):
        out += tap.feed(FIRST[i:i + size])
    assert out == chunk("A", role=True) + chunk("A", "Hel") + chunk("A", "lo")
    assert tap.token_ids == [11, 12, 13]
    assert tap.migratable(max_tokens=8) and not tap.migratable(max_tokens=3)


def test_tap_knows_a_finished_or_done_stream_is_not_migratable():
    tap = StreamTap()
    tap.feed(FIRST + chunk("A", "", finish="length"))
    assert tap.finished and not tap.migratable(None)
    tap = StreamTap()
    tap.feed(b": ids 1\n\n")
    assert not tap.migratable(None)       # nothing reached the client: retry, not migrate


def test_continuation_takes_the_first_streams_id_and_counts_usage():
    tap = StreamTap()
    tap.feed(FIRST)
    cont = Continuation(tap)
    usage = event({"id": "B", "object": "chat.completion.chunk", "created": 9, "model": "m",
                   "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                            "total_tokens": 7}})
    out = cont.feed(b": ids 14\n\n" + chunk("B", role=True) + chunk("B", " wor") + b": ids 15\n\n"
                    + chunk("B", "ld", finish="length") + usage + b"data: [DONE]\n\n")
    events = [e for e in out.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    objs = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
    assert [o["id"] for o in objs] == ["A"] * 3 and {o["created"] for o in objs} == {7}
    assert [o["choices"][0]["delta"]["content"] for o in objs[:2]] == [" wor", "ld"]
    assert objs[2]["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
    assert tap.token_ids == [11, 12, 13, 14, 15] and tap.done


def test_resume_body_keeps_the_prompt_and_asks_for_ids():
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "token_relay": "b64",
            "stream": True}
    out = resume_body(body, [4, 5])
    assert out["messages"] == body["messages"] and "token_relay" not in out
    assert out["disaggregated_params"] == {"resume_token_ids": [4, 5], "stream_token_ids": True}
    assert max_tokens(body) == 9 and max_tokens({"prompt": "x"}) == 16
    assert max_tokens({"messages": [], "max_completion_tokens": 3, "max_tokens": 9}) == 3
    assert max_tokens({"messages": []}) is None
