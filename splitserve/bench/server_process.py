"""A splitserve server (`serve`, `orchestrator`) as a child process on a local port: the GEN
worker `bench frontend` starts, and the workers and orchestrators of the end-to-end tests."""

from __future__ import annotations

import http.client
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request


def free_port(span: int = 1) -> int:
    """A port P with P .. P+span-1 free now (`splitserve up --port P` puts workers on P+1...),
    below Linux's ephemeral ports (32768+): an outgoing connection cannot take one
    meanwhile, nor meet itself on one while a client polls it before its server listens
    (TCP simultaneous open: it would hold the port the server is about to bind)."""
    for port in random.sample(range(10000, 32768 - span), 100):
        socks = [socket.socket() for _ in range(span)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", port + i))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise OSError(f"found no {span} consecutive free ports")


class ServerProcess:
    """`python -m splitserve.cli --log-level WARNING <command...>`, which listens on `port`;
    `threads` sets SPLITSERVE_NUM_THREADS (a worker's torch threads). close() stops it and
    waits (a worker stops its own engine process)."""

    def __init__(self, command: list[str], port: int, threads: int | None = None):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        env = None if threads is None else dict(os.environ, SPLITSERVE_NUM_THREADS=str(threads))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", "--log-level", "WARNING", *command], env=env)

    def wait_healthy(self, timeout: float) -> None:
        """Until GET /health answers 200. RuntimeError if the process exits first,
        TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited with code {self.proc.returncode}")
            if self._answers_health():
                return
            time.sleep(0.2)
        raise TimeoutError(f"{self.url} did not become healthy in {timeout:.0f} s")

    def _answers_health(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
                return r.status == 200
        except (OSError, http.client.HTTPException):   # (up.wait_healthy says when)
            return False

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
