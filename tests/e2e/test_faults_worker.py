"""Faults injected into a real worker process (front-end + engine core, tiny model): the
engine killed with requests streaming and waiting, the engine stopped (SIGSTOP) while it
holds a request, and more waiting requests than the worker takes."""

import json
import os
import signal
import socket
import threading
import time
import urllib.request

import pytest

from server_utils import Worker, alive, engine_pid, get, metrics, post

LONG = 50_000   # tokens: a request that runs until the test ends it


@pytest.fixture(scope="module")
def worker():
    # One sequence runs at a time, so a second request waits; one may wait, a third is shed.
    w = Worker("--model", "tiny-random", "--dtype", "float32", "--max-num-seqs", "1",
               "--max-waiting-requests", "1", "--engine-stall-seconds", "2")
    yield w
    w.close()


class RawStream:
    """A streaming completion over a raw socket, read only when the test asks."""

    def __init__(self, worker, max_tokens: int = LONG):
        body = json.dumps({"model": "tiny-random", "prompt": "x", "max_tokens": max_tokens,
                           "ignore_eos": True, "stream": True}).encode()
        self.sock = socket.create_connection(("127.0.0.1", worker.port), timeout=60)
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                          % (len(body), body))
        self.data = b""
        while b"data: " not in self.data:      # the head and a first token: it runs
            self._read()

    def _read(self) -> None:
        chunk = self.sock.recv(1 << 20)
        assert chunk, f"the stream closed without [DONE]: {self.data[-300:]!r}"
        self.data += chunk

    def until_done(self) -> bytes:
        while b"data: [DONE]" not in self.data:
            self._read()
        return self.data

    def close(self) -> None:
        self.sock.close()


def in_thread(fn, *args, **kwargs):
    out = {}
    t = threading.Thread(target=lambda: out.update(result=fn(*args, **kwargs)), daemon=True)
    t.start()
    return t, out


def wait_for(what, timeout: float = 60.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(every)


def health(worker) -> tuple[int, str]:
    status, body = get(worker.url + "/health")
    return status, body.decode()


def waiting(worker) -> float:
    return metrics(worker.url)["splitserve_num_requests_waiting"]


def completion(worker, **body):
    return post(worker.url + "/v1/completions", {"model": "tiny-random", "prompt": "hi", **body},
                timeout=60)


def test_a_killed_engine_fails_its_requests_and_is_restarted(worker):
    old = engine_pid(worker)
    restarts = metrics(worker.url).get("splitserve_engine_restarts_total", 0)
    running = RawStream(worker)
    # Two prompts in one request: both wait, and the failure of either fails the request.
    t, queued = in_thread(completion, worker, prompt=["hi", "there"], max_tokens=LONG,
                          ignore_eos=True)
    wait_for(lambda: waiting(worker) == 2)
    os.kill(old, signal.SIGKILL)

    data = running.until_done().decode()
    running.close()
    events = [line[len("data: "):] for line in data.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "engine process stopped unexpectedly (signal 9" in error["message"]
    assert "this request was not completed" in error["message"]
    assert error["type"] == "server_error"
    t.join(60)
    status, body = queued["result"]
    assert status == 503 and "stopped unexpectedly (signal 9" in body["error"]["message"]

    status, reason = health(worker)     # the new engine process takes seconds to start
    assert status == 503 and "restarting" in reason and "signal 9" in reason
    wait_for(lambda: health(worker)[0] == 200, timeout=120, every=0.2)
    status, body = completion(worker, max_tokens=3)
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    assert engine_pid(worker) != old and not alive(old)
    assert metrics(worker.url)["splitserve_engine_restarts_total"] == restarts + 1


def test_a_stopped_engine_is_reported_stalled_until_it_continues(worker):
    running = RawStream(worker)
    pid = engine_pid(worker)
    os.kill(pid, signal.SIGSTOP)
    try:
        status, reason = wait_for(lambda: (s := health(worker))[0] == 503 and s, timeout=60)
        assert "stalled" in reason and "no step completed" in reason
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: health(worker)[0] == 200, timeout=60)
    running._read()                      # the stream goes on
    running.close()
    wait_for(lambda: metrics(worker.url)["splitserve_num_requests_running"] == 0)
    assert engine_pid(worker) == pid


def test_more_waiting_requests_than_allowed_are_shed_with_retry_after(worker):
    shed = metrics(worker.url).get("splitserve_requests_shed_total", 0)
    running = RawStream(worker)
    t, queued = in_thread(completion, worker, max_tokens=4)
    wait_for(lambda: waiting(worker) == 1)
    req = urllib.request.Request(worker.url + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": "hi", "max_tokens": 2}).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=60)
    assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "1"
    error = json.loads(refused.value.read())["error"]
    assert "overloaded" in error["message"] and error["type"] == "server_error"
    assert metrics(worker.url)["splitserve_requests_shed_total"] == shed + 1
    assert health(worker)[0] == 200      # busy is not unhealthy

    running.close()                      # the running request ends: the waiting one runs
    t.join(60)
    assert queued["result"][0] == 200
    assert completion(worker, max_tokens=2)[0] == 200
