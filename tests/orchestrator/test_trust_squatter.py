"""A dead worker's port taken by another local process, over real processes: a real
orchestrator, CTX and two GENs; one GEN is killed and a squatter binds its port at once,
answering everything with 200 as a worker would. The squatter gets neither the secret nor
a token any live worker takes; the orchestrator never routes to it, and no client gets its
answer. A worker restarted on that port is verified again and served; the dead instance's
token is refused by it."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import threading

from server_utils import (CLIENT, TEST_SECRET, Orchestrator, Worker, alive, engine_pid, get,
                          internal, metrics, post, wait_for, wait_healthy)
from splitserve.bench.server_process import ServerProcess
from splitserve.trust import INTERNAL_HEADER, Keys

MODEL = ("--model", "tiny-random", "--dtype", "float32")
BODY = {"model": "tiny-random", "prompt": "Once upon a time", "max_tokens": 4,
        "temperature": 0, "ignore_eos": True}
SQUATTED = "the squatter's answer"


class Squatter(http.server.ThreadingHTTPServer):
    """Binds a port and answers every request 200 (a fake load on /health, a fake
    completion elsewhere), keeping every byte of every request it received."""

    daemon_threads = True

    def __init__(self, port: int):
        super().__init__(("127.0.0.1", port), _Squat)
        self.received, self.health_checks, self.posts = bytearray(), 0, 0
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _Squat(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _answer(self, body: dict) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.server.received += self.raw_requestline + self.headers.as_bytes() + \
            self.rfile.read(length)
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.server.health_checks += self.path == "/health"
        self._answer({"status": "ok", "load": {"running": 0, "waiting": 0, "in_flight": 0}})

    def do_POST(self) -> None:
        self.server.posts += 1
        self._answer({"id": "x", "object": "text_completion", "choices": [
            {"index": 0, "text": SQUATTED, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}})


def healthy_gens(orch) -> list[str]:
    return json.loads(get(orch.url + "/health")[1])["healthy"]["gen"]


def kill(worker) -> None:
    pids = [worker.proc.pid, engine_pid(worker)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    worker.proc.wait()
    wait_for(lambda: not any(alive(p) for p in pids), 30, "the worker gone")


def generated(url: str) -> float:
    return metrics(url)["splitserve_generation_tokens_total"]


def test_a_squatter_on_a_dead_workers_port_gets_no_secret_no_token_and_no_client(tmp_path):
    workers = [Worker(*MODEL, "--role", role) for role in ("ctx", "gen", "gen")]
    ctx, gen, victim = workers
    orch, squatter, restarted = None, None, None
    try:
        orch = Orchestrator(tmp_path, [ctx.url], [gen.url, victim.url], gen_router="round_robin",
                            health_check_interval=1.0, load_poll_interval=0, max_retries=2)
        wait_for(lambda: len(healthy_gens(orch)) == 2, 30, "both GENs verified")
        live = {internal(w.url)[INTERNAL_HEADER] for w in (ctx, gen)}
        dead = CLIENT.learn(victim.url)
        kill(victim)
        squatter = Squatter(victim.port)
        # Every client request is served by the other GEN, or refused: never the squatter's
        # answer. Until the orchestrator's next health check it may still route to the dead
        # worker's url (the squatter, then, gets the prompt, and its answer is refused); once
        # it checked the squatter, never.
        answers = []
        for checks in (1, 4):
            while squatter.health_checks < checks:
                status, body = post(orch.url + "/v1/completions", BODY, headers={})
                assert status in (200, 503), body
                answers.append(body.get("choices", [{}])[0].get("text"))
                assert checks == 1 or victim.url not in healthy_gens(orch)
            wait_for(lambda: victim.url not in healthy_gens(orch), 5, "the squatter refused")
        assert SQUATTED not in answers and answers.count(None) < len(answers), answers
        received = bytes(squatter.received)
        squatter.shutdown()
        squatter.server_close()
        squatter = None
        assert TEST_SECRET.encode() not in received
        assert not any(token.encode() in received for token in live)
        # What it may have got (a request sent before the orchestrator noticed the death:
        # docs/security.md) carries the dead instance's token, which the restarted worker
        # refuses.
        restarted = ServerProcess(["serve", "--port", str(victim.port), *MODEL, "--role", "gen"],
                                  victim.port, threads=1)
        wait_healthy(restarted, 180)
        wait_for(lambda: victim.url in healthy_gens(orch), 30, "the restarted GEN verified")
        assert CLIENT.learn(victim.url) != dead
        resume = {**BODY, "disaggregated_params": {"resume_token_ids": [5, 6]}}
        replayed = {INTERNAL_HEADER: Keys(TEST_SECRET).token(dead)}
        assert post(restarted.url + "/v1/completions", resume, headers=replayed)[0] == 403
        assert post(restarted.url + "/v1/completions", resume)[0] == 200   # its own token
        before = generated(restarted.url)
        for _ in range(4):
            assert post(orch.url + "/v1/completions", BODY, headers={})[0] == 200
        assert generated(restarted.url) > before, "the restarted GEN got no request"
    finally:
        if squatter is not None:
            squatter.shutdown()
            squatter.server_close()
        for p in (restarted, orch, *workers):
            if p is not None:
                p.close()
