"""An orchestrator fleet: `splitserve orchestrator --processes N` (YAML `processes: N`) and
`splitserve up --orchestrators N`, N orchestrator processes serving one port.

The parent serves no client. It:
1. makes the fleet's instance id (trust.py), which every child proves on /health: one
   orchestrator to the workers that register with it, whichever child they reach;
2. holds the worker registry (registry.py) behind a control port on loopback, which only
   the token for the fleet's instance opens;
3. starts N children (`splitserve orchestrator --fleet-child CONTROL_URL`). Each binds the
   port with SO_REUSEPORT, so the kernel spreads new connections across them. The cluster
   config, secrets included, and the instance id reach a child as the first line on its
   stdin (never its command line or environment), and the pipe stays open: each later
   newline means "the members changed, read them again", and a child whose parent died
   reads EOF and stops;
4. restarts a child that exits (supervisor.py: 1 s, doubling to 30 s for crash loops)
   while the others keep the port served;
5. on Ctrl-C / SIGTERM stops the children (SIGTERM, SIGKILL after 30 s) and waits for them.

Each child routes on its own, with the workers' reported load (cluster.Server.load), so its
least-loaded choice counts the other children's requests as of the last load poll. A
registration sent to any child is forwarded to the parent; the child that took it updates
its pools from the answer, the others when the parent's newline arrives (and, should one
be lost, before their next round of health checks).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys

import aiohttp
import orjson

from splitserve.httpd import HTTPServer, Request, Response
from splitserve.httpd.connections import Standing
from splitserve.httpd.server import Admission
from splitserve.orchestrator.app import run_orchestrator
from splitserve.orchestrator.cluster import ClusterConfig
from splitserve.orchestrator.registry import NOT_INTERNAL, Registry
from splitserve.orchestrator.supervisor import Supervisor, WorkerChild, stop_processes
from splitserve.protocol.openai import error_body, status_error_body
from splitserve.signals import wait_for_stop_signal
from splitserve.trust import Gate, Keys, new_instance_id

logger = logging.getLogger(__name__)

CONTROL_HOST = "127.0.0.1"
CONTROL_MAX_BODY = 64 << 10


class Control:
    """The parent's loopback HTTP server: the registration API for the children."""

    def __init__(self, registry: Registry, secret: str, instance: str):
        self.registry, self.gate = registry, Gate(None, secret, instance)
        self.http = HTTPServer(self.dispatch, CONTROL_MAX_BODY, "orch-control",
                               error_body=status_error_body, check_head=self.check_head)

    def check_head(self, request: Request) -> Admission | Response:
        """Only the fleet's children, which carry the fleet's token (before any body)."""
        if not self.gate.internal(request.header):
            return Response(error_body(NOT_INTERNAL, "invalid_request_error"), 403)
        return Admission(Standing.INTERNAL, CONTROL_MAX_BODY)

    async def dispatch(self, request: Request) -> Response:
        status, body = self.registry.handle(request.method, request.path, request.body)
        return Response(body, status)

    async def start(self) -> str:
        await self.http.start(CONTROL_HOST, 0, 128)
        return f"http://{CONTROL_HOST}:{self.http.port}"


def child_command(log_level: str, control_url: str) -> list[str]:
    return [sys.executable, "-m", "splitserve.cli", "--log-level", log_level, "orchestrator",
            "--fleet-child", control_url]


def child_payload(config: ClusterConfig, instance: str) -> bytes:
    """The config a child serves with (ClusterConfig.from_dict reads it) and the fleet's
    instance id, one JSON line."""
    raw = dataclasses.asdict(dataclasses.replace(config, processes=1))
    return orjson.dumps({"config": raw, "instance": instance}) + b"\n"


async def _announce(config: ClusterConfig, banner: str) -> None:
    """Print the banner once the port takes connections."""
    while True:
        try:
            _, writer = await asyncio.open_connection(config.host, config.port)
            writer.close()
            break
        except OSError:
            await asyncio.sleep(0.2)
    logger.info("orch: %d orchestrator processes serve http://%s:%d", config.processes,
                config.host, config.port)
    if banner:
        print(banner, flush=True)


async def run_fleet(config: ClusterConfig, log_level: str, banner: str = "",
                    companion=None) -> None:
    """Serve with config.processes children until Ctrl-C / SIGTERM. companion: a coroutine
    function of the registry run alongside (`splitserve up` watches its workers)."""
    registry, instance = Registry(config.remove_unhealthy_after), new_instance_id()
    control = Control(registry, config.internal_secret, instance)
    control_url = await control.start()
    front = f"http://{config.host}:{config.port}"
    payload = child_payload(config, instance)
    children = [WorkerChild(f"orch{i}", front, child_command(log_level, control_url),
                            dict(os.environ), stdin=payload, what="process")
                for i in range(config.processes)]
    supervisor = Supervisor(children, "orch")
    registry.listeners.append(lambda: [c.notify() for c in children])
    session = aiohttp.ClientSession()
    tasks = [asyncio.create_task(c) for c in (
        supervisor.watch(lambda url: None),
        registry.run(session, Keys(config.internal_secret), config.health_check_interval),
        _announce(config, banner),
        *([companion(registry)] if companion is not None else []))]
    try:
        await wait_for_stop_signal()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.to_thread(stop_processes, supervisor.processes())
        await control.http.close()
        await session.close()


def run_child(control_url: str) -> int:
    """A fleet's child: serve with the config on stdin's first line until a signal or the
    parent's end (stdin's EOF)."""
    return asyncio.run(_child(control_url))


async def _child(control_url: str) -> int:
    # stdin read on the event loop, not a thread: nothing holds it at interpreter exit
    parent = asyncio.StreamReader(limit=1 << 20)
    await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(parent), sys.stdin)
    line = await parent.readline()
    if not line:
        return 2
    payload = orjson.loads(line)
    config = ClusterConfig.from_dict(payload["config"], where="the fleet's config")
    orphaned = asyncio.Event()

    async def follow(orch) -> None:
        """Each newline: the members changed. EOF: the parent is gone."""
        while await parent.readline():
            await orch.pools.probes.sync()
        logger.warning("orch: the fleet's parent is gone; stopping")
        orphaned.set()
    await run_orchestrator(config, should_stop=orphaned.is_set, companion=follow,
                           control_url=control_url, instance=payload["instance"])
    return 0
