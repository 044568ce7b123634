"""`splitserve up`: a whole local cluster (CTX and GEN workers + orchestrator) in one command.

Workers are child processes (`splitserve serve --role ...`); the orchestrator runs in this
process. Ctrl-C (or SIGTERM) stops the orchestrator, then every worker, and waits for them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request

from splitserve.orchestrator.app import run_orchestrator
from splitserve.orchestrator.cluster import ClusterConfig, PoolConfig

logger = logging.getLogger(__name__)


def worker_command(args, role: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "splitserve.cli", "--log-level", args.log_level, "serve",
           "--role", role, "--port", str(port), "--host", args.host, "--dtype", args.dtype,
           "--kv-backend", args.kv_backend, "--kv-cache-gib", str(args.kv_cache_gib)]
    if args.model:
        cmd += ["--model", args.model]
    return cmd


def start_workers(args) -> tuple[list[subprocess.Popen], list[str], list[str]]:
    n = args.num_ctx + args.num_gen
    threads = args.threads or max(1, (os.cpu_count() or 1) // n)
    env = dict(os.environ, SPLITSERVE_NUM_THREADS=str(threads))
    procs, ctx_urls, gen_urls = [], [], []
    for i in range(n):
        role = "ctx" if i < args.num_ctx else "gen"
        port = args.port + 1 + i
        procs.append(subprocess.Popen(worker_command(args, role, port), env=env))
        (ctx_urls if role == "ctx" else gen_urls).append(f"http://{args.host}:{port}")
    return procs, ctx_urls, gen_urls


def wait_healthy(procs, urls, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = dict(zip(urls, procs))
    while pending:
        for url, proc in list(pending.items()):
            if proc.poll() is not None:
                raise RuntimeError(f"worker {url} exited with code {proc.returncode} while starting")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        del pending[url]
            except OSError:
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers not healthy after {timeout:.0f} s: {', '.join(pending)}")
        time.sleep(0.3)


def stop_workers(procs: list[subprocess.Popen], timeout: float = 30.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def banner(config: ClusterConfig) -> str:
    url = f"http://{config.host}:{config.port}"
    return (f"\nsplitserve is up: {url}  (ctx: {len(config.context_servers.urls)}, "
            f"gen: {len(config.generation_servers.urls)}); Ctrl-C stops everything\n\n"
            f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f"  -d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of "
            f"France?\"}}], \"max_tokens\": 32, \"temperature\": 0}}'\n")


def _worker_died(procs: list[subprocess.Popen]) -> bool:
    if any(p.poll() is not None for p in procs):
        logger.error("up: a worker exited; stopping the cluster")
        return True
    return False


def up(args) -> int:
    procs, ctx_urls, gen_urls = start_workers(args)
    # Signals during startup must still stop the children.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        wait_healthy(procs, ctx_urls + gen_urls, args.start_timeout)
        config = ClusterConfig(PoolConfig(tuple(ctx_urls), args.ctx_router),
                               PoolConfig(tuple(gen_urls), args.gen_router),
                               host=args.host, port=args.port)
        asyncio.run(run_orchestrator(config, lambda: _worker_died(procs), banner(config)))
        return 0
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as exc:
        logger.error("up: %s", exc)
        return 1
    finally:
        stop_workers(procs)
