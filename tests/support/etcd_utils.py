"""A real etcd server for the tests (Debian's `etcd-server` package, or any `etcd` on the
PATH), on free loopback ports, and synchronous calls to its JSON gateway.

Without an etcd binary the tests that need one skip, saying so; where
SPLITSERVE_REQUIRE_ETCD=1 (.ci/run sets it after installing etcd) they fail instead, so CI
never passes by skipping them."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import urllib.request

import pytest

from server_utils import wait_for
from splitserve.bench.server_process import free_port
from splitserve.etcd import prefix_end

REQUIRE = "SPLITSERVE_REQUIRE_ETCD"


def etcd_binary() -> str:
    """The etcd server's path; skips the test without one (fails where REQUIRE is set)."""
    path = shutil.which("etcd")
    if path is None:
        message = ("no etcd binary (apt-get install etcd-server, or put etcd on the PATH): "
                   "the membership-in-etcd tests need a real etcd server")
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{REQUIRE}=1 and {message}", pytrace=False)
        pytest.skip(message)
    return path


class EtcdServer:
    """One etcd member on 127.0.0.1 with its data in data_dir; stop() and start() again
    keep its ports and data (leases and keys survive, as on a restart)."""

    def __init__(self, data_dir):
        self.binary, self.data_dir = etcd_binary(), str(data_dir)
        port = free_port(2)
        self.endpoint = f"http://127.0.0.1:{port}"
        self.peer = f"http://127.0.0.1:{port + 1}"
        self.proc: subprocess.Popen | None = None
        self.log = open(os.path.join(self.data_dir, "etcd.log"), "ab")
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--name", "test", "--data-dir", os.path.join(self.data_dir, "data"),
             "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
             "--listen-peer-urls", self.peer, "--initial-advertise-peer-urls", self.peer,
             "--initial-cluster", f"test={self.peer}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(self.answers, 30, "etcd answering")

    def answers(self) -> bool:
        assert self.proc.poll() is None, \
            f"etcd exited ({self.proc.returncode}): see {self.log.name}"
        try:
            with urllib.request.urlopen(self.endpoint + "/health", timeout=2) as r:
                return json.loads(r.read()).get("health") == "true"
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)

    def close(self) -> None:
        self.stop()
        self.log.close()

    # -- the JSON gateway, synchronously -------------------------------------------------
    def call(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.endpoint + path, json.dumps(body).encode(),
                                     method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def grant(self, ttl: int) -> str:
        return self.call("/v3/lease/grant", {"TTL": ttl})["ID"]

    def put(self, key: str, value: bytes, lease: str | None = None) -> None:
        body = {"key": _b64(key.encode()), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        self.call("/v3/kv/put", body)

    def revoke(self, lease: str) -> None:
        self.call("/v3/lease/revoke", {"ID": lease})

    def keys(self, prefix: str) -> list[str]:
        answer = self.call("/v3/kv/range", {"key": _b64(prefix.encode()),
                                            "range_end": prefix_end(prefix), "keys_only": True})
        return [base64.b64decode(kv["key"]).decode() for kv in answer.get("kvs", [])]


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")
