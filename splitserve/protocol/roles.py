"""Worker roles, in the cluster's two vocabularies, and the one mapping between them.

A worker's `--role` (`splitserve serve`, server/config.py) is a short label: agg, ctx or
gen; the orchestrator's pools are named ctx and gen as well (its logs and metric labels). It
only labels the worker: what a request does there is set by its
disaggregated_params.request_type. The registration API (internal_api.Registration) and the
orchestrator's messages to clients speak of context and generation workers. An agg worker
serves whole requests, so it registers as a generation worker."""

from __future__ import annotations

WORKER_ROLES = ("agg", "ctx", "gen")
REGISTERED_ROLES = ("context", "generation")
# A worker role (or a pool's name) -> the role it registers as.
REGISTERED_ROLE = {"agg": "generation", "ctx": "context", "gen": "generation"}
