"""`splitserve up`: a whole local cluster (CTX and GEN workers + orchestrator) in one command.

Workers are child processes (`splitserve serve --role ... --register <orchestrator>`): they
join the orchestrator's pools by registering (orchestrator/registry.py), as workers started
anywhere else would. The orchestrator runs in this process, or, with --orchestrators N, as
a fleet of N child processes on the one port that this process supervises (fleet.py). A
worker that exits is restarted (supervisor.py) while the rest keep serving. Ctrl-C (or
SIGTERM) stops the orchestrator(s), then every worker, and waits for them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import sys
import time
import http.client
import urllib.request

import orjson

from splitserve import envs
from splitserve.config import KVTransferConfig
from splitserve.listen import local_url, port_in_use, warn_if_open
from splitserve.model.loader import DEFAULT_MODEL
from splitserve.orchestrator.app import run_orchestrator
from splitserve.orchestrator.cluster import ClusterConfig, PoolConfig
from splitserve.orchestrator.fleet import run_fleet
from splitserve.orchestrator.supervisor import Supervisor, WorkerChild, stop_processes
from splitserve.orchestrator.up_args import QUEUED_PREFILL_CHUNK
from splitserve.planner.config import PlannerConfig
from splitserve.platforms import check_device
from splitserve.placement import (ClusterPlan, WorkerPlan, format_cpus, pin_process,
                                  plan_cluster, usable_cpus)

logger = logging.getLogger(__name__)

KV_HOST = KVTransferConfig.host   # the workers' KV servers bind and advertise (loopback)


def worker_command(args, role: str, port: int, cpus: WorkerPlan) -> list[str]:
    """Workers listen on --worker-host, not --host: exposing the orchestrator exposes no
    worker. They register with the orchestrator at the address this machine reaches it by."""
    cmd = [sys.executable, "-m", "splitserve.cli", "--log-level", args.log_level, "serve",
           "--role", role, "--port", str(port), "--host", args.worker_host, "--dtype", args.dtype,
           "--kv-backend", args.kv_backend, "--kv-cache-gib", str(args.kv_cache_gib),
           "--kv-lease-seconds", str(args.kv_lease_seconds),
           "--threads", str(cpus.engine_threads), "--cpus", format_cpus(cpus.engine_cpus),
           "--frontend-cpus", format_cpus(cpus.frontend_cpus),
           "--device", args.device, "--register", local_url(args.host, args.port)]
    if args.gpu_memory_utilization is not None:   # each worker's own fraction of the GPU
        cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.enforce_eager:
        cmd += ["--enforce-eager"]
    if args.model:
        cmd += ["--model", args.model]
    if args.load_format != "auto":
        cmd += ["--load-format", args.load_format]
    if args.chat_template:
        cmd += ["--chat-template", args.chat_template]
    if args.trust_request_chat_template:
        cmd += ["--trust-request-chat-template"]
    if args.tool_call_parser:
        cmd += ["--tool-call-parser", args.tool_call_parser]
    cmd += ["--grammar-compile-seconds", str(args.grammar_compile_seconds),
            "--drain-grace-seconds", str(args.drain_grace_seconds)]
    if args.cache_isolation != "none":   # a client going around the orchestrator is isolated too
        cmd += ["--cache-isolation", args.cache_isolation]
    cmd += [f for f, on in (("--disable-log-requests", args.disable_log_requests),
                            ("--disable-log-stats", args.disable_log_stats)) if on]
    chunk = prefill_chunk(args)
    if chunk:
        cmd += ["--max-prefill-tokens-while-decoding", str(chunk)]
    if role == "gen" and args.gen_api_servers > 1:
        cmd += ["--api-server-count", str(args.gen_api_servers)]
    return cmd


def prefill_chunk(args) -> int:
    """Every worker's --max-prefill-tokens-while-decoding (a role is a label: the planner
    may make a CTX a GEN): the flag's, else QUEUED_PREFILL_CHUNK when GENs prefill queued
    prompts, else 0."""
    if args.max_prefill_tokens_while_decoding or not args.local_prefill_when_queued:
        return args.max_prefill_tokens_while_decoding
    return QUEUED_PREFILL_CHUNK


def free_ports(first: int, count: int, skip=()) -> list[int]:
    """The first `count` ports from `first` on that nothing listens on now, but `skip`."""
    ports, port = [], first
    while len(ports) < count:
        if port in skip:
            port += 1
            continue
        with socket.socket() as s:
            try:
                s.bind((KV_HOST, port))
                ports.append(port)
            except OSError:
                pass
        port += 1
    return ports


def cluster_secrets(args) -> dict[str, str]:
    """The API keys (--api-key or the environment's) and the internal secret (the
    environment's, else a fresh one) as the variables every child reads them from: a
    command line is readable by every local user, a process's environment is not. Workers
    get the API keys too, so a client that goes around the orchestrator needs one as well."""
    out = {"SPLITSERVE_INTERNAL_SECRET": envs.internal_secret() or secrets.token_urlsafe(32)}
    keys = args.api_key or envs.api_keys()
    if any("," in k for k in keys):   # the workers' variable separates keys by commas
        raise ValueError("an API key must not contain a comma")
    if keys:
        out[envs.API_KEY] = ",".join(keys)
    return out


def child_env(secret_env: dict[str, str]) -> dict[str, str]:
    """Each child's stdin is a pipe this process holds: if it dies, even by SIGKILL, the
    children read EOF and stop (envs.parent_stdin) instead of serving on as orphans."""
    return dict(os.environ, **secret_env, **{envs.PARENT_STDIN: "1"})


class Slots:
    """Where the cluster's workers run: one slot per worker it may hold (`--max-workers`,
    else those it starts with), each a port, a fixed KV port and CPUs. Every worker lists
    every slot's KV endpoint among its peers (it dials no other), not only the CTX
    workers': a role only labels a worker, the planner moves workers between the pools and
    adds some, so a lease may be on any of them. A restarted worker comes back at its
    slot's endpoints."""

    def __init__(self, args, plan: ClusterPlan, secret_env: dict[str, str], skip=()):
        count = len(plan.workers)
        self.args, self.cpus, self.env = args, plan.workers, child_env(secret_env)
        self.ports = [args.port + 1 + i for i in range(count)]
        self.kv_ports = free_ports(args.port + 1 + count, count, skip)
        self.kv_peers = ",".join(f"tcp://{KV_HOST}:{p}" for p in self.kv_ports)
        self.held: dict[int, WorkerChild] = {}

    def start(self, role: str, slot: int) -> WorkerChild:
        port = self.ports[slot]
        kv = ["--kv-port", str(self.kv_ports[slot]), "--kv-peers", self.kv_peers]
        child = WorkerChild(role, local_url(self.args.worker_host, port),
                            worker_command(self.args, role, port, self.cpus[slot]) + kv,
                            self.env, stdin=b"")
        self.held[slot] = child
        return child

    def free(self) -> int | None:
        """The first slot no worker holds (a retired one that exited holds none)."""
        for slot in range(len(self.ports)):
            child = self.held.get(slot)
            if child is None or (child.retired and child.proc.poll() is not None):
                return slot
        return None


def start_workers(args, slots: Slots) -> list[WorkerChild]:
    return [slots.start("ctx" if i < args.num_ctx else "gen", i)
            for i in range(args.num_ctx + args.num_gen)]


class Scaler:
    """Starts and retires workers as the planner asks, one JSON line each on its pipe
    (planner/main.py): {"add": "ctx"|"gen"} takes the first free slot; {"retire": url}
    stops that worker as a SIGTERM does (it leaves the pools, finishes what it holds) and
    it is not started again."""

    def __init__(self, slots: Slots, supervisor: Supervisor):
        self.slots, self.supervisor = slots, supervisor

    def handle(self, line: bytes) -> None:
        try:
            ask = orjson.loads(line)
        except orjson.JSONDecodeError:
            ask = None
        if isinstance(ask, dict) and ask.get("add") in ("ctx", "gen"):
            slot = self.slots.free()
            if slot is None:
                logger.warning("up: the planner asked for another %s worker; every one of "
                               "the %d slots is taken", ask["add"], len(self.slots.ports))
                return
            child = self.supervisor.add(self.slots.start(ask["add"], slot))
            logger.info("up: started %s (pid %d) for the planner", child, child.proc.pid)
        elif isinstance(ask, dict) and isinstance(ask.get("retire"), str):
            if not self.supervisor.retire(ask["retire"]):
                logger.warning("up: the planner asked to retire %s, which is not one of "
                               "this cluster's workers", ask["retire"][:200])
        else:
            logger.warning("up: the planner sent a request up does not know: %r", line[:200])

    async def listen(self, fd: int) -> None:
        """Until cancelled: the planner's requests on the pipe's read end."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                     os.fdopen(fd, "rb", buffering=0))
        while line := await reader.readline():
            self.handle(line)


def start_planner(args, secret_env: dict[str, str], port: int,
                  scale_fd: int | None) -> WorkerChild:
    """`splitserve planner` on this cluster's orchestrator, its /metrics on `port`; where it
    may start workers (--max-workers), scale_fd is the write end of the pipe it asks on."""
    cmd = [sys.executable, "-m", "splitserve.cli", "--log-level", args.log_level, "planner",
           "--orchestrator", local_url(args.host, args.port), "--port", str(port),
           "--interval", str(args.planner_interval), "--window", str(args.planner_window),
           "--cooldown", str(args.planner_cooldown)]
    for name in ("ttft_p90_ms", "itl_p90_ms", "max_workers"):
        if getattr(args, name) is not None:
            cmd += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    env = child_env(secret_env)
    if scale_fd is not None:
        env[envs.PLANNER_SCALE_FD] = str(scale_fd)
    return WorkerChild("planner", local_url(KV_HOST, port), cmd, env, stdin=b"",
                       what="process", pass_fds=() if scale_fd is None else (scale_fd,))


def check_planner(args) -> None:
    """The planner's settings, checked before anything starts (a usage error)."""
    if not args.planner:
        if args.ttft_p90_ms is not None or args.itl_p90_ms is not None \
                or args.max_workers is not None:
            raise ValueError("--ttft-p90-ms, --itl-p90-ms and --max-workers are the "
                             "planner's: add --planner")
        return
    PlannerConfig(ttft_p90_ms=args.ttft_p90_ms, itl_p90_ms=args.itl_p90_ms,
                  interval=args.planner_interval, window=args.planner_window,
                  cooldown=args.planner_cooldown, max_workers=args.max_workers)
    if args.max_workers is not None and args.max_workers < args.num_ctx + args.num_gen:
        raise ValueError(f"--max-workers ({args.max_workers}) is fewer than the workers up "
                         f"starts with ({args.num_ctx + args.num_gen})")


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
            # HTTPException: not yet an HTTP server there; e.g. a connection to a port in the
            # ephemeral range nobody listens on yet can meet itself (TCP simultaneous open)
            except (OSError, http.client.HTTPException):
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers not healthy after {timeout:.0f} s: {', '.join(pending)}")
        time.sleep(0.3)


def banner(config: ClusterConfig, args) -> str:
    url = f"http://{config.host}:{config.port}"
    auth = "  -H 'Authorization: Bearer <your API key>' \\\n" if config.api_key else ""
    fleet = f", orchestrators: {config.processes}" if config.processes > 1 else ""
    return (f"\nsplitserve is up: {url}  (ctx: {args.num_ctx}, gen: {args.num_gen}{fleet}); "
            f"Ctrl-C stops everything\n\n"
            f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f"{auth}"
            f"  -d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of "
            f"France?\"}}], \"max_tokens\": 32, \"temperature\": 0}}'\n")


def cluster_config(args, secret_env: dict[str, str]) -> ClusterConfig:
    """The orchestrator's config, with no urls: the workers register (--register) and come
    and go like any others. Warns if it serves beyond loopback with no API key."""
    config = ClusterConfig(PoolConfig((), args.ctx_router), PoolConfig((), args.gen_router),
                           host=args.host, port=args.port, processes=args.orchestrators,
                           api_key=tuple(args.api_key or envs.api_keys()),
                           cache_isolation=args.cache_isolation,
                           internal_secret=secret_env["SPLITSERVE_INTERNAL_SECRET"],
                           local_prefill_max_tokens=args.local_prefill_max_tokens,
                           local_prefill_when_queued=args.local_prefill_when_queued,
                           local_prefill_gen_slowdown=args.local_prefill_gen_slowdown,
                           max_in_flight=args.max_in_flight,
                           first_byte_timeout=args.first_byte_timeout,
                           idle_timeout=args.idle_timeout, model=args.model or DEFAULT_MODEL,
                           load_format=args.load_format,
                           chat_template=args.chat_template,
                           trust_request_chat_template=args.trust_request_chat_template,
                           disable_log_requests=args.disable_log_requests,
                           allowed_origins=args.allowed_origins or ())
    warn_if_open("up", config.host, config.api_key)
    return config


def up(args) -> int:
    slots = max(args.num_ctx + args.num_gen, args.max_workers or 0)
    plan = plan_cluster(usable_cpus(), slots, args.threads)
    for i, cpus in enumerate(plan.workers):
        logger.info("up: worker %d: %s", i, cpus.describe())
    # Workers are told their CPUs on their command lines, so they may leave this one's.
    pin_process(plan.orchestrator_cpus, "orchestrator")
    logger.info("up: orchestrator on CPUs %s", format_cpus(plan.orchestrator_cpus))
    # Built before any worker starts: a value it refuses is a usage error, with nothing to stop.
    try:
        check_device(args.device)
        check_planner(args)
        secret_env = cluster_secrets(args)
        config = cluster_config(args, secret_env)
    except ValueError as exc:
        logger.error("up: %s", exc)
        return 2
    problem = port_in_use(config.host, config.port)
    if problem is not None:    # before any worker starts and registers with what holds it
        logger.error("up: %s", problem)
        return 1
    planner_port = free_ports(args.port + 1 + len(plan.workers), 1)[0] if args.planner else None
    slots = Slots(args, plan, secret_env, skip={planner_port})
    children = start_workers(args, slots)
    scale_read, scale_write = os.pipe() if args.max_workers is not None else (None, None)
    if planner_port is not None:
        children.append(start_planner(args, secret_env, planner_port, scale_write))
    supervisor = Supervisor(children)
    scaler = Scaler(slots, supervisor) if scale_read is not None else None

    async def tend(on_exit) -> None:
        """The companion: restart what exits; start and retire what the planner asks."""
        if scaler is None:
            await supervisor.watch(on_exit)
        else:
            await asyncio.gather(supervisor.watch(on_exit), scaler.listen(scale_read))
    # Signals during startup must still stop the children.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        workers = [c for c in children if c.role != "planner"]
        wait_healthy([c.proc for c in workers], [c.url for c in workers], args.start_timeout)
        if config.processes > 1:
            asyncio.run(run_fleet(config, args.log_level, banner(config, args),
                                  companion=lambda registry: tend(registry.forget)))
        else:
            asyncio.run(run_orchestrator(config, banner=banner(config, args),
                                         companion=lambda orch: tend(orch.mark_down)))
        return 0
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as exc:
        logger.error("up: %s", exc)
        return 1
    finally:
        # Stopping: a second Ctrl-C must not leave workers behind unwaited for.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_processes(supervisor.processes())
