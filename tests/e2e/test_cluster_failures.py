"""Workers dying under the orchestrator, and `splitserve up` cleaning up after itself."""

import json
import os
import signal
import socket

from server_utils import (Orchestrator, UpCluster, alive, descendants, get, metrics, post,
                          start_workers, wait_for)

MODEL = ("--model", "tiny-random", "--dtype", "float32")
BODY = {"model": "tiny-random", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}


def kill(worker) -> None:
    worker.proc.send_signal(signal.SIGKILL)
    worker.proc.wait()


def test_dead_generation_workers(tmp_path):
    gen = (*MODEL, "--role", "gen")
    ctx, *gens = start_workers((*MODEL, "--role", "ctx", "--kv-lease-seconds", "2"), gen, gen)
    orch = Orchestrator(tmp_path, [ctx.url], [g.url for g in gens], gen_router="round_robin")
    try:
        _, want = post(orch.url + "/v1/completions", BODY)
        kill(gens[0])
        for _ in range(3):   # retried on the live worker before any byte reached the client
            status, got = post(orch.url + "/v1/completions", BODY)
            assert status == 200 and got["choices"][0]["text"] == want["choices"][0]["text"]
        # Mid-stream death: the client gets an error event and the end of the stream.
        events = stream_then_kill(orch, gens[1])
        error = events[-2]["error"]     # said in the client's terms, then [DONE]
        assert error["message"].startswith("the generation worker stopped while streaming")
        status, err = post(orch.url + "/v1/completions", BODY)
        assert status == 503
        assert err["error"]["message"] == "no generation worker is available; retry later"
        # Nobody pulled the last context's KV: the lease runs out and frees the blocks.
        wait_for(lambda: metrics(ctx.url)["splitserve_kv_blocks_leased"] == 0, 10, "lease expiry")
        assert metrics(ctx.url)["splitserve_kv_blocks_used"] == 0
    finally:
        for p in (orch, *gens, ctx):
            p.close()


def stream_then_kill(orch, gen) -> list:
    body = json.dumps({**BODY, "max_tokens": 4000, "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", orch.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    data = sock.recv(65536)
    assert b"200" in data.split(b"\r\n", 1)[0]
    kill(gen)
    while chunk := sock.recv(65536):
        data += chunk
        if b"[DONE]" in data:
            break
    sock.close()
    events = []
    for line in data.split(b"\n"):
        line = line.strip()
        if line.startswith(b"data: {"):
            events.append(json.loads(line[6:]))
        elif line == b"data: [DONE]":
            events.append("[DONE]")
    assert events[-1] == "[DONE]"
    return events


def test_dead_context_worker_is_routed_around(tmp_path):
    ctx = (*MODEL, "--role", "ctx")
    *ctxs, gen = start_workers(ctx, ctx, (*MODEL, "--role", "gen"))
    orch = Orchestrator(tmp_path, [c.url for c in ctxs], [gen.url])
    try:
        kill(ctxs[0])
        for _ in range(4):
            assert post(orch.url + "/v1/completions", BODY)[0] == 200
        wait_for(lambda: json.loads(get(orch.url + "/health")[1])["healthy"]["ctx"] == [ctxs[1].url],
                 10, "health check marks the dead worker")
    finally:
        for p in (orch, gen, *ctxs):
            p.close()


def test_workers_stop_when_up_is_killed():
    """`up` killed with SIGKILL runs no cleanup: its workers see EOF on the stdin pipe it
    held and stop, instead of serving on as orphans that hold their ports."""
    up = UpCluster(*MODEL)
    try:
        family = descendants(up.proc.pid)
        assert len(family) >= 4     # two workers, each with an engine process
        os.kill(up.proc.pid, signal.SIGKILL)
        up.proc.wait()
        wait_for(lambda: not any(alive(p) for p in family), 60, "every worker gone")
    finally:
        up.close()


def test_up_then_ctrl_c_leaves_no_process(tmp_path):
    log = tmp_path / "up.log"
    up = UpCluster(*MODEL, log=log)
    try:
        assert post(up.url + "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})[0] == 200
        assert len(descendants(up.proc.pid)) >= 4     # two workers, each with an engine process
        up.interrupt()
    finally:
        up.close()
    # the workers stop after the orchestrator: its absence is no failure to warn about
    assert "failed" not in log.read_text(), log.read_text()[-2000:]
