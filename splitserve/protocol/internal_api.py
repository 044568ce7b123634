"""The cluster's internal HTTP API between its rooms: the paths a worker serves the
orchestrator and the orchestrator serves workers, their bodies, and the one timing header.
Only requests carrying the cluster's internal token reach these paths; the token, challenge,
identity and proof headers are trust.py's (a shared base module, as this one is), together
with how they are derived.

    GET  KV_BLOCKS_PATH        a worker's prefix-cache report (kv_blocks_body, served by
                               server/kv_blocks.py), read by the orchestrator's KV-aware
                               routing (read_kv_blocks, orchestrator/kv_index.py)
    POST WORKERS_PATH          Registration: join an orchestrator's pools or renew the lease
    POST WORKERS_REMOVE_PATH   Removal: leave them (server/registration.py sends both;
                               orchestrator/registry.py serves them)
    POST WORKERS_ROLE_PATH     RoleAssignment: move a member to the other pool (the
                               planner sends it, splitserve/planner/)
    GET  /health               a worker's "load" (load_body), read by the orchestrator's
                               health checks and load polls (reported_load)
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING

import msgspec

from splitserve.protocol.block_hashes import split_hashes

if TYPE_CHECKING:
    from splitserve.protocol.engine import KVBlocks

KV_BLOCKS_PATH = "/internal/kv_blocks"
WORKERS_PATH = "/internal/workers"
WORKERS_REMOVE_PATH = "/internal/workers/remove"
WORKERS_ROLE_PATH = "/internal/workers/role"
# When the sender wrote the request (time.time(), repr): a worker measures its preprocessing
# from it, so time queued in front of its event loop counts (server/generate.py).
SENT_AT_HEADER = "X-Sent-At"


class Registration(msgspec.Struct, forbid_unknown_fields=True):
    role: str                 # roles.REGISTERED_ROLES
    url: str                  # the worker's base url
    ttl: float = 30.0         # seconds the lease lasts without another heartbeat


class Removal(msgspec.Struct, forbid_unknown_fields=True):
    url: str


class RoleAssignment(msgspec.Struct, forbid_unknown_fields=True):
    """A member's pool from now on, whatever role its heartbeats say (a role only labels a
    worker: protocol/roles.py), until it leaves; its own role again clears it."""
    url: str
    role: str                 # roles.REGISTERED_ROLES


def kv_blocks_body(report: KVBlocks | None, since: str | None = None) -> dict:
    """A worker's answer on KV_BLOCKS_PATH: {"version", "block_size", "total", "hashes":
    base64 of the chained hashes back to back}; {"version", "unchanged": true} when the
    asker's `since` is the report's version; an empty report before the engine sent one."""
    if report is None:
        return {"version": "", "block_size": 0, "total": 0, "hashes": ""}
    if since == report.version:
        return {"version": report.version, "unchanged": True}
    return {"version": report.version, "block_size": report.block_size, "total": report.total,
            "hashes": base64.b64encode(report.hashes).decode("ascii")}


def read_kv_blocks(body) -> tuple[str, int, list[bytes]] | None:
    """(version, block_size, hashes) of a kv_blocks_body; None for `unchanged` or anything
    malformed."""
    if not isinstance(body, dict) or body.get("unchanged") is True:
        return None
    version, block_size, raw = body.get("version"), body.get("block_size"), body.get("hashes")
    if not (isinstance(version, str) and isinstance(block_size, int) and isinstance(raw, str)):
        return None
    try:
        return version, block_size, split_hashes(base64.b64decode(raw, validate=True))
    except ValueError:   # not base64 (binascii.Error), or not whole hashes
        return None


def load_body(running: int, waiting: int, in_flight: int, kv_usage: float,
              prefill_tokens: int = 0) -> dict:
    """A worker's /health "load": its engine's running and waiting requests, KV use and
    prompt tokens still to compute (engine-wide), and the generation requests open on its
    front-ends."""
    return {"running": running, "waiting": waiting, "in_flight": in_flight,
            "kv_usage": kv_usage, "prefill_tokens": prefill_tokens}


def reported_prefill(load) -> tuple[int, int] | None:
    """(prompt tokens still to compute, running requests) a load_body says the worker
    holds; None unless both are well-formed (a worker from before the field: None)."""
    try:
        tokens, running = int(load["prefill_tokens"]), int(load["running"])
    except (KeyError, TypeError, ValueError):
        return None
    return (tokens, running) if tokens >= 0 and running >= 0 else None


def reported_load(load) -> int | None:
    """The requests a load_body says the worker holds: max(running + waiting, in_flight),
    as in_flight also counts those not yet submitted to the engine. None unless load is
    well-formed."""
    try:
        return max(int(load["running"]) + int(load["waiting"]), int(load["in_flight"]))
    except (KeyError, TypeError, ValueError):
        return None
