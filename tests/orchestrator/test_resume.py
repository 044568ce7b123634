"""orchestrator/resume.py: every event of a stream gets an id, a resumed stream is the rest
of the first one (same ids, no repeats, no gaps) at any chunk boundary, and each
resumption that cannot be served is a clear 4xx naming why."""

import asyncio
import json

import pytest

from splitserve.httpd import Response
from splitserve.orchestrator.app import Orchestrator
from splitserve.orchestrator.cluster import ClusterConfig, PoolConfig
from splitserve.orchestrator.resume import (EventStream, Numbering, Refused, StreamIds, digest,
                                            not_reproducible, numbered)

SECRET = "s"
BODY = {"model": "m", "prompt": "hi", "max_tokens": 4, "temperature": 0, "stream": True}


def event(text: str, finish=None, rid: str = "cmpl-1", created: int = 7) -> bytes:
    obj = {"id": rid, "object": "text_completion", "created": created, "model": "m",
           "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


STREAM = (event("a") + event("b") + b": keep-alive\n\n" + event("c") + event("", "length")
          + b"data: [DONE]\n\n")
ERROR = b'data: {"error":{"message":"the generation worker stopped"}}\n\n'


class Client:
    """What the client's connection receives (a ChunkedStream's write and end)."""

    def __init__(self):
        self.opened, self.data, self.ended = 0, b"", False
        self.conn = self                 # (conn.transport.is_closing(): the client left)
        self.transport, self.closing = self, False

    def is_closing(self) -> bool:
        return self.closing

    def stream(self, headers: dict, status: int = 200) -> "Client":
        self.opened += 1
        return self

    async def write(self, data: bytes) -> None:
        self.data += data

    def end(self) -> None:
        self.ended = True


def relayed(stream: bytes, skip: int = 0, size: int = 10_000, stamp: bytes = b"5.sig"):
    """(the answer, what the client got) of `stream` written in chunks of `size` bytes."""
    client = Client()
    out = EventStream(client, Numbering(stamp, skip), {}, 200)

    async def run():
        for i in range(0, len(stream), size):
            await out.write(stream[i:i + size])
    asyncio.run(run())
    return out.answer(), client


def events(data: bytes) -> list[tuple[str, bytes]]:
    """(id, data line) of each event; comments dropped."""
    out = []
    for e in data.split(b"\n\n"):
        lines = e.split(b"\n")
        if lines[0].startswith(b"id: "):
            out.append((lines[0][4:].decode(), lines[1]))
    return out


@pytest.mark.parametrize("size", [1, 5, 64, 10_000])
def test_each_event_gets_the_next_id_whatever_the_chunks(size):
    answer, client = relayed(STREAM, size=size)
    got = events(client.data)
    assert [i for i, _ in got] == ["1.5.sig", "2.5.sig", "3.5.sig", "4.5.sig", "4.5.sig"]
    assert got[-1][1] == b"data: [DONE]" and b": keep-alive\n\n" in client.data
    assert answer is client and client.opened == 1


@pytest.mark.parametrize("skip", [0, 1, 2, 3, 4])
def test_a_resumed_stream_is_the_rest_without_repeats_or_gaps(skip):
    whole = events(relayed(STREAM)[1].data)
    _, client = relayed(STREAM, skip=skip, size=7)
    have = [e for e in whole if int(e[0].split(".")[0]) <= skip and e[1] != b"data: [DONE]"]
    assert have + events(client.data) == whole


def test_an_error_event_keeps_the_id_before_it_so_the_stream_resumes_after_it():
    broken = event("a") + event("b") + ERROR + b"data: [DONE]\n\n"
    got = events(relayed(broken)[1].data)
    assert [i.split(".")[0] for i, _ in got] == ["1", "2", "2", "2"]
    _, client = relayed(STREAM, skip=2)
    texts = [json.loads(e[1][6:])["choices"][0]["text"] for e in events(client.data)[:2]]
    assert texts == ["c", ""]


def test_chunks_carry_the_streams_response_id_and_created_not_the_workers():
    """A second run's worker names its response anew: the client sees the first run's."""
    again = STREAM.replace(b'"cmpl-1"', b'"cmpl-2"').replace(b'"created":7', b'"created":9')
    first, second = relayed(STREAM)[1].data, relayed(again)[1].data
    assert first == second and b"cmpl-1" not in first
    obj = json.loads(events(first)[0][1][6:])
    assert obj["id"].startswith("cmpl-") and obj["created"] == 5


def test_a_last_event_id_past_the_end_is_a_416_and_nothing_is_streamed():
    answer, client = relayed(STREAM, skip=5)
    assert answer.status == 416 and client.opened == 0
    assert json.loads(answer.body)["error"]["param"] == "Last-Event-ID"
    answer, client = relayed(STREAM, skip=4)       # all the client lacks is [DONE]
    assert events(client.data) == [("4.5.sig", b"data: [DONE]")]


def test_a_client_gone_while_its_events_are_skipped_stops_the_second_run():
    client = Client()
    out = EventStream(client, Numbering(b"5.sig", skip=3), {}, 200)
    asyncio.run(out.write(event("a")))
    client.closing = True
    with pytest.raises(ConnectionResetError):
        asyncio.run(out.write(event("b")))


def test_a_resumed_stream_that_fails_before_the_rest_answers_its_error():
    answer, client = relayed(event("a") + ERROR + b"data: [DONE]\n\n", skip=3)
    assert answer.status == 502 and client.opened == 0
    assert b"stopped" in answer.body


def test_a_whole_sse_answer_is_numbered_too():
    whole = Response(STREAM, content_type="text/event-stream")
    got = numbered(whole, Numbering(b"5.sig"))
    assert events(got.body) == events(relayed(STREAM)[1].data)
    assert numbered(whole, Numbering(b"5.sig", skip=9)).status == 416
    plain = Response(b"{}")
    assert numbered(plain, Numbering(b"5.sig")) is plain


def ids(window: float = 600.0) -> StreamIds:
    return StreamIds(SECRET, window)


def test_an_id_resumes_only_its_own_request_key_and_body():
    d = digest("/v1/completions", BODY)
    stamp = ids().stamp("req-1", "key-a", d, started=1000).decode()
    assert ids().check(f"7.{stamp}", "req-1", "key-a", d, now=1100) == (7, 1000)
    reordered = digest("/v1/completions", dict(reversed(BODY.items())))
    assert ids().check(f"7.{stamp}", "req-1", "key-a", reordered, now=1100) == (7, 1000)
    for rid, key, body, status in [
            ("req-2", "key-a", d, 404), ("req-1", "key-b", d, 404), ("req-1", None, d, 404),
            ("req-1", "key-a", digest("/v1/completions", {**BODY, "max_tokens": 5}), 409),
            ("req-1", "key-a", digest("/v1/chat/completions", BODY), 409)]:
        with pytest.raises(Refused) as exc:
            ids().check(f"7.{stamp}", rid, key, body, now=1100)
        assert exc.value.status == status
    forged = f"8.{stamp}".replace("1000", "1001")
    for last, status, now in [(forged, 404, 1100), (f"7.{stamp}", 410, 1601),
                              ("7", 400, 1100), ("x.1.abc", 400, 1100)]:
        with pytest.raises(Refused) as exc:
            ids().check(last, "req-1", "key-a", d, now=now)
        assert exc.value.status == status and exc.value.message
    with pytest.raises(Refused) as exc:
        ids(window=0).check(f"7.{stamp}", "req-1", "key-a", d, now=1000)
    assert exc.value.status == 400 and "resume_window" in exc.value.message


def test_only_a_request_whose_events_are_a_function_of_it_resumes():
    assert not_reproducible(BODY, split=False) is None
    assert not_reproducible({**BODY, "temperature": 0.8, "seed": 3}, split=False) is None
    assert "seed" in not_reproducible({**BODY, "temperature": 0.8}, split=False)
    assert "seed" in not_reproducible({"prompt": "x"}, split=False)    # temperature 1
    assert "order" in not_reproducible({**BODY, "n": 2}, split=True)


async def _refusal(body: dict, keys=(), **headers) -> tuple[int, dict]:
    """The orchestrator's answer to a resumption it refuses before any worker (none here)."""
    nowhere = PoolConfig(("http://127.0.0.1:9",))
    orch = Orchestrator(ClusterConfig(nowhere, nowhere, port=0, internal_secret=SECRET,
                                      api_key=keys))
    await orch.start()
    try:
        raw = json.dumps(body).encode()
        head = "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in headers.items())
        reader, writer = await asyncio.open_connection("127.0.0.1", orch.http.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s"
                     % (len(raw), head.encode(), raw))
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        answer = json.loads(await reader.readexactly(length))
        writer.close()
        return int(head.split()[1]), answer["error"]
    finally:
        await orch.stop()


def test_the_orchestrator_names_why_a_resumption_is_refused():
    sampled = {**BODY, "temperature": 0.7}
    stamp = ids().stamp("r1", None, digest("/v1/completions", sampled)).decode()
    for body, last, status, param in [
            ({**BODY, "stream": False}, f"1.{stamp}", 400, "Last-Event-ID"),
            (BODY, "nonsense", 400, "Last-Event-ID"),
            (BODY, f"1.{stamp}", 409, "body"),        # not the body this id was sent for
            (sampled, f"1.{stamp}", 409, "seed")]:
        status_got, error = asyncio.run(_refusal(body, Last_Event_ID=last, X_Request_Id="r1"))
        assert (status_got, error["param"]) == (status, param), error


def test_a_stream_resumes_only_with_the_api_key_it_was_sent_to():
    stamp = ids().stamp("r1", "key-a", digest("/v1/completions", BODY)).decode()
    status, error = asyncio.run(_refusal(BODY, keys=("key-a", "key-b"), Last_Event_ID=f"1.{stamp}",
                                         X_Request_Id="r1", Authorization="Bearer key-b"))
    assert (status, error["param"]) == (404, "Last-Event-ID"), error
    status, error = asyncio.run(_refusal(BODY, keys=("key-a", "key-b"), Last_Event_ID=f"1.{stamp}",
                                         X_Request_Id="r1", Authorization="Bearer key-a"))
    assert status >= 500, error         # accepted: served again, on no worker here

