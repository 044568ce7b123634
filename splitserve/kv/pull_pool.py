"""GEN's pulls, scheduled so that one CTX cannot hold up the others.

A dispatcher thread hands pulls to a few worker threads, at most one pull at a time per CTX
endpoint (its socket carries one conversation at a time), so pulls from different CTXs run
side by side and a CTX that stops answering holds up only the pulls waiting on it. When a
CTX is unavailable (refused, connection lost, no answer in time) the pulls queued for it
fail with the same error instead of each waiting out the timeout again. An endpoint's Peer
is kept between pulls and closed after a failure or `idle_seconds` without a pull.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from splitserve.kv.base import PullResult
from splitserve.kv.sockets import BadReply, Peer, PeerUnavailable, PullRefused
from splitserve.protocol.engine import KVHandle

logger = logging.getLogger(__name__)

CLOSED = "the KV transport was closed"


@dataclass
class Job:
    handle: KVHandle
    dst: np.ndarray                 # local blocks for the lease's blocks from `skip` on
    done: Callable[[PullResult], None]
    skip: int = 0                   # the lease's first blocks the GEN has already
    with_tokens: bool = False       # the prompt's token ids come too


@dataclass
class _Finished:
    endpoint: str
    peer: Peer | None         # None: closed after a failure
    unavailable: str | None   # why the CTX is unavailable, if it is


def finish(job: Job, result: PullResult) -> None:
    try:
        job.done(result)
    except Exception:   # the engine's callback; a bug there must not stop the pull threads
        logger.exception("kv: a pull's completion callback failed")


class PullPool:
    def __init__(self, name: str, threads: int, idle_seconds: float,
                 open_peer: Callable[[str], Peer],
                 run: Callable[[Peer, Job], tuple[int, np.ndarray | None]]):
        self.idle_seconds = idle_seconds
        self.open_peer, self.run = open_peer, run
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()   # Jobs, _Finished, None: stop
        self.work: queue.SimpleQueue = queue.SimpleQueue()    # (Job, Peer | None), None: stop
        self.backlog: dict[str, deque[Job]] = {}   # per endpoint, in arrival order
        self.busy: set[str] = set()
        self.idle: dict[str, Peer] = {}
        self.free = threads
        self.stop = threading.Event()
        self._closed, self._lock = False, threading.Lock()
        self.workers = [threading.Thread(target=self._work, daemon=True, name=f"kv-{name}-pull-{i}")
                        for i in range(threads)]
        self.threads = [threading.Thread(target=self._dispatch, daemon=True,
                                         name=f"kv-{name}-pull"), *self.workers]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if not self._closed:
                self.inbox.put(job)
                return
        finish(job, PullResult(False, error=CLOSED))

    def close(self, join_seconds: float = 10.0) -> None:
        """Every pull gets its done() call: in-flight ones end within a poll slice, the
        queued ones fail."""
        with self._lock:
            self._closed = True
        self.stop.set()
        self.inbox.put(None)
        self.threads[0].join(timeout=join_seconds)

    # -- dispatcher thread ----------------------------------------------------------------
    def _dispatch(self) -> None:
        tick = min(1.0, self.idle_seconds / 2)
        while True:
            try:
                msg = self.inbox.get(timeout=tick)
            except queue.Empty:
                msg = ()
            if msg is None:
                break
            try:
                self._take(msg)
                self._schedule()
                self._close_idle()
            except Exception:   # bookkeeping only; never expected, never fatal
                logger.exception("kv: pull dispatcher error")
        self._shutdown()

    def _take(self, msg) -> None:
        if isinstance(msg, Job):
            self.backlog.setdefault(msg.handle.endpoint, deque()).append(msg)
        elif isinstance(msg, _Finished):
            self.busy.discard(msg.endpoint)
            self.free += 1
            if msg.peer is not None:
                msg.peer.last_used = time.monotonic()
                self.idle[msg.endpoint] = msg.peer
            if msg.unavailable is not None:
                for job in self.backlog.pop(msg.endpoint, ()):
                    finish(job, PullResult(False, error=msg.unavailable))

    def _schedule(self) -> None:
        for endpoint in list(self.backlog):
            if not self.free:
                return
            if endpoint in self.busy:
                continue
            jobs = self.backlog[endpoint]
            job = jobs.popleft()
            if not jobs:
                del self.backlog[endpoint]
            self.busy.add(endpoint)
            self.free -= 1
            self.work.put((job, self.idle.pop(endpoint, None)))

    def _close_idle(self) -> None:
        now = time.monotonic()
        for endpoint, peer in list(self.idle.items()):
            if now - peer.last_used > self.idle_seconds:
                del self.idle[endpoint]
                peer.close()

    def _shutdown(self) -> None:
        for _ in self.workers:
            self.work.put(None)
        deadline = time.monotonic() + 5   # in-flight pulls see the stop flag within a poll slice
        for t in self.workers:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        while not self.inbox.empty():
            msg = self.inbox.get()
            if isinstance(msg, Job):
                finish(msg, PullResult(False, error=CLOSED))
            elif isinstance(msg, _Finished) and msg.peer is not None:
                msg.peer.close()
        for jobs in self.backlog.values():
            for job in jobs:
                finish(job, PullResult(False, error=CLOSED))
        for peer in self.idle.values():
            peer.close()

    # -- worker threads -------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            item = self.work.get()
            if item is None:
                return
            job, peer = item
            peer, unavailable = self._run(job, peer)
            self.inbox.put(_Finished(job.handle.endpoint, peer, unavailable))

    def _run(self, job: Job, peer: Peer | None) -> tuple[Peer | None, str | None]:
        """Runs one pull; returns the peer if its conversation is still in step, and why
        the CTX is unavailable if it is."""
        t0, unavailable = time.perf_counter(), None
        try:
            if peer is None:
                peer = self.open_peer(job.handle.endpoint)
            nbytes, tokens = self.run(peer, job)
            result = PullResult(True, nbytes=nbytes, seconds=time.perf_counter() - t0,
                                tokens=tokens)
        except Exception as exc:   # any failure ends this pull, never the thread
            if isinstance(exc, PeerUnavailable):
                unavailable = str(exc)
            elif not isinstance(exc, (PullRefused, BadReply, RuntimeError, TimeoutError)):
                logger.exception("kv: pull from %s failed", job.handle.endpoint)
            if not isinstance(exc, PullRefused) and peer is not None:
                peer.close()   # out of step, or to a peer that failed: a new pull starts afresh
                peer = None
            result = PullResult(False, error=str(exc) or type(exc).__name__,
                                seconds=time.perf_counter() - t0)
        finish(job, result)
        return peer, unavailable
