"""`splitserve planner`: moves workers between the context and generation pools at run time
to keep the cluster within the operator's latency SLOs.

A worker's role only labels it (protocol/roles.py): every worker serves every request type,
so a move is a membership change at the orchestrator (POST /internal/workers/role), never a
restart. What the worker holds finishes where it is: prefills it is running, leases it keeps
until pulled, streams it decodes; it only stops being offered the old pool's new requests.

The planner is a program of its own, like a worker it speaks to the cluster over HTTP with
the internal secret: it reads the member list from an orchestrator, scrapes each member's
/metrics, and decides (policy.py) from windowed histograms (window.py).
"""
