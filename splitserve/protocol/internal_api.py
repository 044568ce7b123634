"""The cluster's internal HTTP API between its rooms: the paths a worker serves the
orchestrator and the orchestrator serves workers, their bodies, and the one timing header.
Only requests carrying the cluster's internal token reach these paths; the token, challenge,
identity and proof headers are trust.py's (a shared base module, as this one is), together
with how they are derived.

    GET  KV_BLOCKS_PATH        a worker's prefix-cache report (server/kv_blocks.py), read by
                               the orchestrator's KV-aware routing (orchestrator/kv_index.py)
    POST WORKERS_PATH          Registration: join an orchestrator's pools or renew the lease
    POST WORKERS_REMOVE_PATH   Removal: leave them (server/registration.py sends both;
                               orchestrator/registry.py serves them)
"""

from __future__ import annotations

import msgspec

KV_BLOCKS_PATH = "/internal/kv_blocks"
WORKERS_PATH = "/internal/workers"
WORKERS_REMOVE_PATH = "/internal/workers/remove"
# When the sender wrote the request (time.time(), repr): a worker measures its preprocessing
# from it, so time queued in front of its event loop counts (server/generate.py).
SENT_AT_HEADER = "X-Sent-At"


class Registration(msgspec.Struct, forbid_unknown_fields=True):
    role: str                 # roles.REGISTERED_ROLES
    url: str                  # the worker's base url
    ttl: float = 30.0         # seconds the lease lasts without another heartbeat


class Removal(msgspec.Struct, forbid_unknown_fields=True):
    url: str
