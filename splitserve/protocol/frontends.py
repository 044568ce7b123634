"""Messages between `splitserve serve`'s parent process and its front-end processes
(`--api-server-count N`, server/frontends.py), over one pipe per front-end (msgpack).

The parent owns the engine process: it tells every front-end when a life of the engine
starts (bind this life's sockets), is ready, or has died. Each front-end reports its
metrics twice a second; the parent passes each report on to the other front-ends, so that
/metrics and /health on any of them give the worker's totals."""

from __future__ import annotations

import msgspec

from splitserve.protocol.engine import EngineReady

# metric name -> [(label values, state)]: a counter's or gauge's [value], a histogram's
# per-bucket counts then its sum and count (splitserve/metrics.py, state()).
MetricsState = dict[str, list[tuple[list[str], list[float]]]]


class EngineStarting(msgspec.Struct, tag="starting"):
    """Life `life` of the engine is being spawned: bind its sockets (frontends.peer_sockets)."""
    life: int


class EngineUp(msgspec.Struct, tag="up"):
    ready: EngineReady
    restarts: int              # lives before this one


class EngineDown(msgspec.Struct, tag="down"):
    """The engine died (or failed to start): what is in flight fails, new requests get 503."""
    reason: str


class FrontendReport(msgspec.Struct, tag="report"):
    """One front-end's own metrics (not the engine's, which every front-end receives)."""
    peer: int
    in_flight: int             # generation requests open in it
    metrics: MetricsState


ControlMessage = EngineStarting | EngineUp | EngineDown | FrontendReport
