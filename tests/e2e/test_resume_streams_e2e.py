"""A client whose orchestrator process is killed mid-stream resumes the stream through the
fleet's other process (or its restart) with Last-Event-ID: the text it ends with is an
uninterrupted run's, greedy and seeded, and the ids run 1, 2, ... with no repeat and no gap."""

import http.client
import json
import os
import signal
import time

import pytest

from server_utils import Orchestrator, Worker, alive, wait_for

MODEL = ("--model", "tiny-random", "--dtype", "float32")
BODY = {"model": "tiny-random", "prompt": "Once upon a time", "max_tokens": 40,
        "ignore_eos": True, "stream": True}
CHAT = {"model": "tiny-random", "messages": [{"role": "user", "content": "Once upon a time"}],
        "max_tokens": 40, "ignore_eos": True, "stream": True}
KEPT = 12     # events the client reads before its orchestrator process dies


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two orchestrator processes on one port, one CTX, one GEN."""
    started = []
    try:
        started += [Worker(*MODEL, "--role", "ctx"), Worker(*MODEL, "--role", "gen")]
        started.append(Orchestrator(tmp_path_factory.mktemp("fleet"), [started[0].url],
                                    [started[1].url], processes=2))
        yield started[-1]
    finally:
        for p in reversed(started):
            p.close()


def open_stream(port: int, body: dict, rid: str, last: str | None = None):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    """(connection, response, pid of the orchestrator process serving it): /health asked
    first on the same keep-alive connection names the process."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("GET", "/health")
    pid = json.loads(conn.getresponse().read())["pid"]
    headers = {"Content-Type": "application/json", "X-Request-Id": rid}
    if last is not None:
        headers["Last-Event-ID"] = last
    conn.request("POST", path, json.dumps(body), headers)
    return conn, conn.getresponse(), pid


def reconnect(port: int, body: dict, rid: str, last: str, timeout: float = 30.0):
    """open_stream again, as a client does after it lost one: tried until a process of the
    fleet takes the connection (the only other one may be restarting itself)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return open_stream(port, body, rid, last)
        except (ConnectionError, http.client.RemoteDisconnected):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def read_events(resp, limit: int | None = None) -> list[tuple[str, str]]:
    """(id, data) of each SSE event, up to limit events."""
    out, event_id = [], None
    while limit is None or len(out) < limit:
        line = resp.readline().decode()
        if not line:
            break
        if line.startswith("id: "):
            event_id = line[4:].strip()
        elif line.startswith("data: "):
            out.append((event_id, line[6:].strip()))
    return out


def text(events) -> str:
    out = []
    for _, d in events:
        choices = json.loads(d)["choices"] if d != "[DONE]" else []
        for c in choices:
            out.append(c["text"] if "text" in c else c["delta"].get("content") or "")
    return "".join(out)


def serial(event_id: str) -> int:
    return int(event_id.split(".")[0])


@pytest.mark.parametrize("name, body", [
    ("greedy", {**BODY, "temperature": 0}), ("seeded", {**BODY, "temperature": 0.9, "seed": 7}),
    ("chat-seeded", {**CHAT, "temperature": 0.9, "seed": 5})])
def test_a_stream_resumes_through_another_process_after_its_own_is_killed(fleet, name, body):
    conn, resp, _ = open_stream(fleet.port, body, f"clean-{name}")
    clean = read_events(resp)
    conn.close()
    assert clean[-1][1] == "[DONE]" and len(clean) > KEPT + 2 and text(clean)

    rid = f"cut-{name}"
    conn, resp, pid = open_stream(fleet.port, body, rid)
    assert resp.status == 200 and resp.getheader("X-Request-Id") == rid
    have = read_events(resp, KEPT)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not alive(pid), 10, "the orchestrator process gone")
    conn.close()

    conn, resp, other = reconnect(fleet.port, body, rid, have[-1][0])
    assert other != pid and resp.status == 200, resp.read()
    rest = read_events(resp)
    conn.close()
    whole = have + rest
    assert text(whole) == text(clean)
    counted = [serial(i) for i, d in whole if d != "[DONE]"]
    assert counted == list(range(1, len(counted) + 1))        # no repeat, no gap
    assert whole[-1] == (whole[-2][0], "[DONE]")
    ids = {json.loads(d)["id"] for _, d in whole if d != "[DONE]"}
    assert len(ids) == 1                  # one response, whichever process sent a chunk


def test_a_last_event_id_past_the_end_or_for_another_body_is_refused(fleet):
    body = {**BODY, "temperature": 0, "max_tokens": 4}
    conn, resp, _ = open_stream(fleet.port, body, "short")
    events = read_events(resp)
    conn.close()
    stamp = events[-1][0].split(".", 1)[1]
    for changed, last, status in [(body, f"{len(events) + 3}.{stamp}", 416),
                                  ({**body, "max_tokens": 5}, events[1][0], 409)]:
        conn, resp, _ = open_stream(fleet.port, changed, "short", last=last)
        error = json.loads(resp.read())["error"]
        conn.close()
        assert resp.status == status and error["message"], error
