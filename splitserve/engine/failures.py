"""How EngineCore ends one request that failed, so that nothing else does.

A mixin of EngineCore: it uses the engine's scheduler (which changes the request's state)
and output (OutputBuilder). Every method runs on the engine thread.
"""

from __future__ import annotations

import logging

from splitserve.engine.request import FinishReason, Request
from splitserve.protocol.engine import CompletionDelta

logger = logging.getLogger("splitserve.engine.core")


class FailureHandling:
    def _discard_group(self, request_id: str) -> None:
        """Forget a group that never fully entered the engine, freeing whatever it took."""
        for req in self.scheduler.discard_group(request_id):
            self.output.forget(req)

    def _guard(self, req: Request, out: list[CompletionDelta], doing: str, fn, *args):
        """fn(*args); if it raises, req ends with an error and the result is None."""
        try:
            return fn(*args)
        except Exception:
            logger.exception("engine: request %s failed while %s", req.request_id, doing)
            self._fail(req, out, doing)
            return None

    def _fail(self, req: Request, out: list[CompletionDelta], doing: str) -> None:
        if req.is_finished:
            return
        error = f"internal error while {doing} (see the worker's log)"
        try:
            self._finish(req, FinishReason.ERROR, out, error=error)
        except Exception:
            logger.exception("engine: ending request %s failed", req.request_id)
            if not req.is_finished:   # beyond repair: forget it without its bookkeeping
                self._drop(req, out, error)   # (else it ended and was told; freeing failed)

    def _fail_all(self, requests: list[Request], out: list[CompletionDelta],
                  doing: str = "running the engine's step") -> None:
        for req in requests:
            self._fail(req, out, doing)

    def _drop(self, req: Request, out: list[CompletionDelta], error: str) -> None:
        """req (and its never-forked siblings) leave without their bookkeeping: each gets
        a bare error delta."""
        for r in self.scheduler.drop(req):
            self.output.forget(r)
            out.append(CompletionDelta(r.group_id, r.index, [], "", error=error,
                                       finish_reason=int(FinishReason.ERROR)))
