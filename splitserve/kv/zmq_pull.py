"""The pull conversation both built-in KV backends hold over ZeroMQ; they differ only in how
the bytes move.

CTX: a ROUTER socket answers each PullRequest (after kv.base.check_pull) with the reply a
subclass's `_offer` builds, and releases a lease on its PullAck. GEN: one thread runs pulls
one after another over one DEALER socket per CTX endpoint: request, reply, the subclass's
`_receive` puts the bytes into local blocks, ack.
"""

from __future__ import annotations

import abc
import logging
import queue
import threading
import time
from typing import Callable

import msgspec
import numpy as np
import torch
import zmq

from splitserve.kv.base import KVTransport, LeaseView, PullResult, check_pull
from splitserve.kv.messages import PullAck, PullRequest
from splitserve.protocol.engine import KVHandle

logger = logging.getLogger(__name__)


class ZmqPullTransport(KVTransport):
    """Owns a ZeroMQ context, a serving thread and a pulling thread; `close` joins both, then
    fails the pulls still queued so every pull gets its done() call."""

    reply_type: type[msgspec.Struct]   # the backend's reply; has `error: str | None = None`

    def __init__(self, kv_cache: torch.Tensor, layout: str, host: str = "127.0.0.1",
                 port: int = 0, timeout: float = 30.0):
        super().__init__(kv_cache, layout)
        self.host, self.port, self.timeout = host, port, timeout
        self.ctx = zmq.Context()
        self.jobs: queue.Queue = queue.Queue()
        self.endpoint = ""
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @abc.abstractmethod
    def _offer(self, blocks: np.ndarray) -> list:
        """CTX: the reply frames that hand these leased blocks to the GEN."""

    @abc.abstractmethod
    def _receive(self, handle: KVHandle, reply, frames: list, dst: np.ndarray,
                 deadline: float) -> int:
        """GEN: copy the offered blocks into dst (frames: those after the reply); returns
        the bytes copied."""

    # -- CTX side -------------------------------------------------------------------------
    def start(self, leases: LeaseView) -> str:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.port:
            sock.bind(f"tcp://{self.host}:{self.port}")
            port = self.port
        else:
            port = sock.bind_to_random_port(f"tcp://{self.host}")
        self.endpoint = f"tcp://{self.host}:{port}"
        self._threads = [
            threading.Thread(target=self._serve, args=(sock, leases), daemon=True,
                             name=f"kv-{self.name}-serve"),
            threading.Thread(target=self._pull_loop, daemon=True, name=f"kv-{self.name}-pull")]
        for t in self._threads:
            t.start()
        return self.endpoint

    def _serve(self, sock: zmq.Socket, leases: LeaseView) -> None:
        decoder = msgspec.msgpack.Decoder(PullRequest | PullAck)
        try:
            while not self._stop.is_set():
                if not sock.poll(200):
                    continue
                ident, payload = sock.recv_multipart()
                try:
                    msg = decoder.decode(payload)
                except msgspec.DecodeError:
                    logger.warning("kv-%s: dropped an undecodable message", self.name)
                    continue
                if isinstance(msg, PullAck):
                    leases.release(msg.ctx_request_id)
                    continue
                sock.send_multipart([ident, *self._answer(msg, leases)], copy=False)
        finally:
            sock.close(linger=0)

    def _answer(self, msg: PullRequest, leases: LeaseView) -> list:
        error, blocks = check_pull(leases, self.layout, msg.ctx_request_id, msg.layout,
                                   msg.num_blocks)
        if error is not None:
            return [msgspec.msgpack.encode(self.reply_type(error=error))]
        return self._offer(blocks)

    # -- GEN side -------------------------------------------------------------------------
    def pull(self, handle: KVHandle, dst_blocks: np.ndarray,
             done: Callable[[PullResult], None]) -> None:
        self.jobs.put((handle, dst_blocks, done))

    def _pull_loop(self) -> None:
        socks: dict[str, zmq.Socket] = {}
        while not self._stop.is_set():
            try:
                handle, dst, done = self.jobs.get(timeout=0.2)
            except queue.Empty:
                continue
            t0 = time.perf_counter()
            try:
                nbytes = self._pull_one(socks, handle, dst, t0 + self.timeout)
                result = PullResult(True, nbytes=nbytes, seconds=time.perf_counter() - t0)
            except Exception as exc:   # any failure ends this request, never the thread
                result = PullResult(False, error=str(exc), seconds=time.perf_counter() - t0)
            done(result)
        for sock in socks.values():
            sock.close(linger=0)

    def _pull_one(self, socks: dict, handle: KVHandle, dst: np.ndarray, deadline: float) -> int:
        sock = socks.get(handle.endpoint)
        if sock is None:
            sock = socks[handle.endpoint] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(handle.endpoint)
        sock.send(msgspec.msgpack.encode(PullRequest(handle.ctx_request_id, self.layout, len(dst))))
        if not sock.poll(max(0, int((deadline - time.perf_counter()) * 1000))):
            sock.close()   # a late reply must not be read as the answer to the next pull
            del socks[handle.endpoint]
            raise TimeoutError(f"context worker KV server {handle.endpoint} did not answer "
                               f"within {self.timeout:.0f} s")
        frames = sock.recv_multipart(copy=False)
        reply = msgspec.msgpack.decode(frames[0].buffer, type=self.reply_type)
        if reply.error is not None:
            raise RuntimeError(reply.error)
        nbytes = self._receive(handle, reply, frames[1:], dst, deadline)
        sock.send(msgspec.msgpack.encode(PullAck(handle.ctx_request_id)))
        return nbytes

    def health(self) -> str | None:
        dead = [t.name for t in self._threads if not t.is_alive()]
        return f"KV transport threads stopped: {', '.join(dead)}" if dead else None

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        while not self.jobs.empty():   # every pull gets its done() call, even at shutdown
            self.jobs.get()[2](PullResult(False, error="the KV transport was closed"))
        self.ctx.destroy(linger=0)
