"""GET /internal/kv_blocks (protocol/internal_api.py): which prefix blocks this worker's engine holds, for the
orchestrator's KV-aware router (orchestrator/kv_index.py). Internal: only a request that
carries this worker's internal token (trust.py) gets an answer; which prompts a worker has
seen is nobody else's business.

The body is JSON: {"version", "block_size", "total", "hashes"}; hashes is base64 of the
16-byte chained block hashes back to back (engine/kv_report.py bounds how many: at most
256 KiB). `?since=<version>` answers {"version", "unchanged": true} when nothing changed,
so a poller pays for the list only when it moved."""

from __future__ import annotations

import base64

from splitserve.httpd import Request, Response, json_response
from splitserve.protocol.openai import error_body
from splitserve.trust import Gate

_MAX_SINCE = 64     # a version is 8 hex digits, a dash and a counter


async def kv_blocks_response(request: Request, gate: Gate, engine) -> Response:
    """engine: server.engine_link.EngineLink, whose kv_blocks is the last report."""
    if not gate.internal(request.header):
        return Response(error_body("this endpoint is internal: it needs the cluster's internal "
                                   "token for this server", "invalid_request_error"), 403)
    report = engine.kv_blocks
    if report is None:   # no report yet (starting, or a new engine): nothing cached
        return json_response({"version": "", "block_size": 0, "total": 0, "hashes": ""})
    since = _since(request.query)
    if since == report.version:
        return json_response({"version": report.version, "unchanged": True})
    return json_response({"version": report.version, "block_size": report.block_size,
                          "total": report.total,
                          "hashes": base64.b64encode(report.hashes).decode("ascii")})


def _since(query: bytes) -> str | None:
    for part in query[:_MAX_SINCE + 8].split(b"&"):
        name, _, value = part.partition(b"=")
        if name == b"since":
            return value.decode("ascii", "replace")
    return None
