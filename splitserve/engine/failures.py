"""How EngineCore ends one request that failed, so that nothing else does.

A mixin of EngineCore: it uses the engine's groups, scheduler and output (OutputBuilder).
Every method runs on the engine thread.
"""

from __future__ import annotations

import logging

from splitserve.engine.request import FinishReason, Request, RequestStatus
from splitserve.protocol.engine import CompletionDelta

logger = logging.getLogger("splitserve.engine.core")


class FailureHandling:
    def _discard_group(self, request_id: str) -> None:
        """Forget a group that never fully entered the engine, freeing whatever it took."""
        for req in self.groups.pop(request_id, ()):
            self._forget(req)

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
            self.output.finish(req, FinishReason.ERROR, out, error=error)
        except Exception:   # its state is beyond repair: forget it without its bookkeeping
            logger.exception("engine: ending request %s failed", req.request_id)
            self._drop(req, out, error)

    def _fail_all(self, requests: list[Request], out: list[CompletionDelta],
                  doing: str = "running the engine's step") -> None:
        for req in requests:
            self._fail(req, out, doing)

    def _drop(self, req: Request, out: list[CompletionDelta], error: str) -> None:
        for r in (req, *req.siblings):
            self._forget(r)
            out.append(CompletionDelta(r.group_id, r.index, [], "", error=error,
                                       finish_reason=int(FinishReason.ERROR)))
        req.siblings = []
        if all(r.is_finished for r in self.groups.get(req.group_id, ())):
            self.groups.pop(req.group_id, None)

    def _forget(self, req: Request) -> None:
        """Take req out of every structure and free its blocks, without finishing it."""
        req.status = RequestStatus.FINISHED_ERROR
        self.output.forget(req)
        try:
            self.scheduler.remove(req)
        except Exception:
            logger.exception("engine: request %s's blocks could not be freed", req.request_id)
