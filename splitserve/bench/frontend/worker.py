"""The GEN worker `splitserve bench frontend` measures: one it starts with
--kv-backend none, or one given with --url, whose /health must report that backend."""

from __future__ import annotations

import json
import os
import urllib.request

from splitserve import envs
from splitserve.bench.frontend.config import BenchError, FrontendBenchConfig
from splitserve.bench.server_process import ServerProcess, free_port
from splitserve.internal_client import OPENER, InternalClient


def tiny_layout(block_size: int) -> tuple[str, int, int]:
    """(layout fingerprint, vocab size, KV bytes per block) of tiny-random in float32."""
    import torch

    from splitserve.kv.base import layout_fingerprint
    from splitserve.model.loader import load_model_source
    cfg = load_model_source("tiny-random").config
    return (layout_fingerprint(cfg, torch.float32, block_size), cfg.vocab_size,
            block_size * cfg.kv_bytes_per_token(4))


class BenchWorker(ServerProcess):
    """`splitserve serve` as a tiny-random GEN worker with --kv-backend none in a
    subprocess; `args` are its serve arguments, as the result records them."""

    def __init__(self, cfg: FrontendBenchConfig, block_bytes: int, frontends: int = 1):
        port = free_port()
        self.frontends = frontends
        # 2 GiB by default: 262144 blocks, 32 prompts of 128k. With max_tokens 1 a request
        # holds its blocks from the engine step that allocates them to the next, which frees
        # them, so the pool bounds how many are admitted per step, not per second: the
        # engine's bookkeeping costs about 1 us per block either way (7 ms per 128k prompt
        # at block size 16). Waits for blocks show in the queue column.
        num_blocks = int(cfg.kv_cache_gib * (1 << 30)) // block_bytes
        # No prefix caching: hashing a list/b64 prompt's blocks is engine work that would
        # compete with the front-end for the same cores and blur the comparison.
        self.args = ["--model", "tiny-random", "--dtype", "float32", "--role", "gen",
                     "--kv-backend", "none", "--port", str(port), "--block-size",
                     str(cfg.block_size), "--num-blocks", str(num_blocks), "--max-num-seqs",
                     str(max(cfg.concurrency)), "--max-num-batched-tokens",
                     str(max(512, max(cfg.concurrency))), "--no-prefix-caching"]
        if frontends > 1:
            self.args += ["--api-server-count", str(frontends)]
        super().__init__(["serve", *self.args], port, threads=1)

    def wait_healthy(self, timeout: float = 180.0) -> None:
        try:
            super().wait_healthy(timeout)
        except (RuntimeError, TimeoutError) as exc:
            raise BenchError(f"the worker {exc}") from None

    def engine_cpu_seconds(self) -> float | None:
        """CPU time of the worker's child processes (its engine core), from /proc; None
        with several front-ends, which are children too."""
        if self.frontends > 1:
            return None
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                return sum(_cpu_seconds(int(pid)) for pid in f.read().split())
        except OSError:
            return None


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads) from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()   # the name may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def get_json(url: str) -> dict:
    secret = envs.internal_secret()   # its token in place of an API key the worker may require
    request = urllib.request.Request(url)
    try:
        opened = (InternalClient(secret).urlopen(request, timeout=10) if secret
                  else OPENER.open(request, timeout=10))
        with opened as r:
            return json.loads(r.read())
    except (OSError, ValueError) as exc:
        raise BenchError(f"GET {url} failed: {exc}") from None


def check_kv_backend(url: str) -> dict:
    """/health of the worker; refuse it unless its KV backend is `none` (it pulls nothing)."""
    health = get_json(url.rstrip("/") + "/health")
    if health.get("kv_backend") != "none":
        raise BenchError(
            f"refusing {url}: its /health reports kv_backend {health.get('kv_backend')!r}, "
            "not 'none'. The benchmark's generation_only requests carry a KV handle that "
            "points nowhere (tcp://127.0.0.1:1), so a worker that really pulls KV fails every "
            "one of them; start it with `splitserve serve ... --kv-backend none`, or leave out "
            "--url and let this command start one")
    return health
