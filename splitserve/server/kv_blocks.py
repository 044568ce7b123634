"""GET /internal/kv_blocks: which prefix blocks this worker's engine holds, for the
orchestrator's KV-aware router (orchestrator/kv_index.py). Internal: only a request that
carries this worker's internal token (trust.py) gets an answer; which prompts a worker has
seen is nobody else's business.

The body is protocol/internal_api.kv_blocks_body: the chained block hashes, base64
(engine/kv_report.py bounds how many: at most 256 KiB). `?since=<version>` answers
{"version", "unchanged": true} when nothing changed, so a poller pays for the list only
when it moved."""

from __future__ import annotations

from splitserve.httpd import Request, Response, json_response
from splitserve.protocol.internal_api import kv_blocks_body
from splitserve.protocol.openai import error_body
from splitserve.trust import Gate

_MAX_SINCE = 64     # a version is 8 hex digits, a dash and a counter


async def kv_blocks_response(request: Request, gate: Gate, engine) -> Response:
    """engine: server.engine_link.EngineLink, whose kv_blocks is the last report."""
    if not gate.internal(request.header):
        return Response(error_body("this endpoint is internal: it needs the cluster's internal "
                                   "token for this server", "invalid_request_error"), 403)
    return json_response(kv_blocks_body(engine.kv_blocks, _since(request.query)))


def _since(query: bytes) -> str | None:
    for part in query[:_MAX_SINCE + 8].split(b"&"):
        name, _, value = part.partition(b"=")
        if name == b"since":
            return value.decode("ascii", "replace")
    return None
