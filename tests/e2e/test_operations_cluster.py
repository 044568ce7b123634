"""Operations through real processes: a busy port is one line before anything loads, and
X-Request-Id reaches every worker a request touches; /version on the orchestrator."""

import socket
import subprocess
import sys
import time

import pytest

from server_utils import call, logged_up, post
from splitserve.version import __version__


@pytest.mark.parametrize("command", [["serve", "--model", "tiny-random"],
                                     ["up", "--model", "tiny-random"],
                                     ["orchestrator", "-c", "CLUSTER"]])
def test_a_busy_port_is_one_line_before_anything_loads(command, tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("internal_secret: s\ncontext_servers: []\ngeneration_servers: []\n")
    command = [str(cluster) if c == "CLUSTER" else c for c in command]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        t = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "splitserve.cli", *command, "--port",
                               str(port)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and time.monotonic() - t < 20
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and f"port {port} on 127.0.0.1 is already in use" in errors[0]
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    yield from logged_up(tmp_path_factory, "ops")


def test_the_request_id_reaches_every_worker_it_touches(up):
    cluster, log = up
    body = {"model": "tiny-random", "prompt": "The sky is", "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    status, answer, headers = call("POST", cluster.url + "/v1/completions", body,
                                   {"X-Request-Id": "trace-7"})
    assert status == 200 and headers["X-Request-Id"] == "trace-7", answer
    time.sleep(0.5)     # the workers' lines reach the log
    lines = [line for line in log.read_text().splitlines() if "request trace-7 " in line]
    by = {line.split(": request")[0].split()[-1] for line in lines}
    assert "orch" in by and any(b.startswith("ctx:") for b in by) and \
        any(b.startswith("gen:") for b in by), lines
    gen_line = next(line for line in lines if " gen:" in line)
    assert "completion 4 tokens" in gen_line and "TTFT" in gen_line, gen_line


def test_version_on_the_orchestrator(up):
    cluster, _ = up
    status, body, _ = call("GET", cluster.url + "/version")
    assert status == 200 and body == {"version": __version__}
    assert post(cluster.url + "/tokenize", {"prompt": "hi"})[0] == 200
