"""A keyless client floods the orchestrator with connections that send nothing (ten
thousand from one address, reopening each one closed), with the orchestrator's file
descriptor limit as the machine gives it and at 1,024: a client with the API key is
served throughout, the worker's heartbeats keep reaching the orchestrator, and the log
stays small. Real processes on real sockets: an orchestrator, a tiny-model worker that
registers itself, the flooding client."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from server_utils import TEST_SECRET, get, wait_for

from splitserve.bench.server_process import free_port

KEY = "sk-flood-test"
FLOOD = Path(__file__).parent.parent / "support" / "flood_client.py"


def start(args: list[str], log: Path, fd_limit: int | None = None) -> subprocess.Popen:
    def limit():
        if fd_limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "splitserve.cli", "--log-level", "INFO",
                                 *args], stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=limit,
                                env=dict(os.environ, SPLITSERVE_NUM_THREADS="1"))


def completion(url: str) -> int:
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps({"prompt": [1, 2, 3], "max_tokens": 4}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=20) as r:
        r.read()
        return r.status


def healthy_gens(url: str) -> list:
    try:
        return json.loads(get(url + "/health")[1])["healthy"]["gen"]
    except OSError:
        return []


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.parametrize("fd_limit", [None, 1024])
def test_idle_connections_from_one_client_starve_neither_clients_nor_heartbeats(tmp_path,
                                                                                 fd_limit):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "port": port, "api_key": KEY, "internal_secret": TEST_SECRET,
        "health_check_interval": 0.5, "local_prefill_max_tokens": 256,
        "context_servers": {"urls": []}, "generation_servers": {"urls": []}}))
    orch_log, worker_log = tmp_path / "orch.log", tmp_path / "worker.log"
    orch = start(["orchestrator", "-c", str(config)], orch_log, fd_limit)
    worker = start(["serve", "--model", "tiny-random", "--role", "gen", "--port",
                    str(free_port()), "--register", url], worker_log)
    try:
        wait_for(lambda: len(healthy_gens(url)) == 1, 120, "the worker registered")
        flood = subprocess.Popen([sys.executable, str(FLOOD), "127.0.0.1", str(port), "10000",
                                  "12", "60000"], stdout=subprocess.PIPE)
        time.sleep(2)
        statuses, fds = [], []
        for _ in range(5):                       # meanwhile, a client with the key
            statuses.append(completion(url))
            fds.append(open_fds(orch.pid))
            time.sleep(1.5)
        out, _ = flood.communicate(timeout=60)
        stats = json.loads(out)
        members = healthy_gens(url)
    finally:
        for p in (worker, orch):
            p.terminate()
            p.wait(30)
    worker_says, orch_says = worker_log.read_text(), orch_log.read_text()
    assert stats["opened"] >= 10000, stats
    assert statuses == [200] * 5
    # held: 256 silent ones from one address, and a burst of accepts (up to the listen
    # backlog, 2,048 at most) before the server sees them, closes them
    assert sorted(fds)[len(fds) // 2] < 1000 and max(fds) < (fd_limit or 1 << 16), fds
    assert len(members) == 1                   # heartbeats went on: the worker stayed
    assert "registering with" not in worker_says, worker_says[-2000:]
    assert len(orch_says) < 1 << 20 and "Traceback" not in orch_says, orch_says[-2000:]
