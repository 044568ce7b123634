"""The pull conversation both built-in KV backends hold over ZeroMQ; they differ only in how
the bytes move.

CTX: a ROUTER socket answers each PullRequest (after kv.base.check_pull) with the reply a
subclass's `_offer` builds, and releases a lease on its PullAck; whatever else arrives is
dropped with a warning. GEN: kv.pull_pool runs the pulls, one at a time per CTX endpoint and
side by side across CTXs; each is request, reply, checks, the subclass's `_receive` puts the
bytes into local blocks, ack. A PullRequest may skip the lease's first blocks (the GEN has
them) and ask for the prompt's int32 ids, which follow the blocks as one more frame. A reply
is checked whole before a byte is copied: a wrong one fails its pull and writes nothing. Given the cluster's secret, both sides speak CURVE
(kv/curve.py); without it the channel is plaintext. With SPLITSERVE_KV_FAULTS set (fault
campaigns only) the CTX's answers take the faults armed there (kv/faults.py).
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from typing import Callable

import msgspec
import numpy as np
import torch
import zmq

from splitserve import envs
from splitserve.kv.base import KVTransport, LeaseView, PullResult, check_pull
from splitserve.kv.checksums import LeaseSums
from splitserve.kv.curve import CurveKeys, ZapHandler
from splitserve.kv.faults import FaultPlan
from splitserve.kv.messages import MAX_REQUEST_BYTES, PullAck, PullRequest
from splitserve.kv.pull_pool import Job, PullPool
from splitserve.kv.sockets import (BadReply, Peer, PullRefused, Throttled, close_monitored,
                                   monitor_events, server_socket)
from splitserve.protocol.engine import KVHandle

logger = logging.getLogger(__name__)

MAX_ERROR_CHARS = 500   # of a CTX's error text passed on to the request


class ZmqPullTransport(KVTransport):
    """Owns a ZeroMQ context, a serving thread and the pull pool's threads; `close` joins
    them and fails the pulls still queued, so every pull gets its done() call."""

    reply_type: type[msgspec.Struct]   # the backend's reply: ctx_request_id, error, ...

    def __init__(self, kv_cache: torch.Tensor, layout: str, host: str = "127.0.0.1",
                 port: int = 0, timeout: float = 30.0, connect_timeout: float = 5.0,
                 idle_seconds: float = 60.0, pull_threads: int = 8, secret: str | None = None,
                 platform=None):
        super().__init__(kv_cache, layout, platform)
        self.host, self.port, self.timeout = host, port, timeout
        self.connect_timeout = connect_timeout
        self.keys = CurveKeys.from_secret(secret) if secret else None
        self.ctx = zmq.Context()
        self.endpoint = ""
        self._stop = threading.Event()
        self._warn = Throttled()
        self.pool = PullPool(self.name, pull_threads, idle_seconds, self._open_peer, self._pull_one)
        self._threads: list[threading.Thread] = []
        self._own_threads: list[threading.Thread] = []   # serving, sums, ZAP: joined on close
        # CTX: the offered blocks' checksums, summed as each lease starts.
        # The block's bytes on the host: the cache's own on a CPU, a copy from a GPU.
        self.lease_sums = LeaseSums(
            lambda b: self.platform.blocks_to_host([self.block_bytes(b)])[0], self.name)
        # Faults injected into the answers, for fault campaigns only (off: None).
        fault_dir = envs.kv_faults()
        self.faults = FaultPlan(fault_dir, self.name) if fault_dir else None

    @abc.abstractmethod
    def _offer(self, ctx_request_id: str, blocks: np.ndarray) -> tuple[msgspec.Struct, list]:
        """CTX: the reply and the frames after it that hand these leased blocks to the GEN."""

    @abc.abstractmethod
    def _receive(self, handle: KVHandle, reply, frames: list, dst: np.ndarray,
                 deadline: float) -> int:
        """GEN: check the offer (frames: those after the reply; raise BadReply before
        writing anything if it does not fit dst), copy it into dst, return the bytes."""

    @abc.abstractmethod
    def _max_frame(self) -> int:
        """GEN: the largest frame a CTX's answer may hold (ZMQ_MAXMSGSIZE of its socket)."""

    # -- CTX side -------------------------------------------------------------------------
    def start(self, leases: LeaseView) -> str:
        # The ZAP handler first: a CURVE server without one would admit any client key.
        zap = [ZapHandler(self.ctx, self.keys, self._stop).thread] if self.keys else []
        sock, self.endpoint, monitor = server_socket(self.ctx, self.host, self.port, self.keys)
        serve = threading.Thread(target=self._serve, args=(sock, monitor, leases), daemon=True,
                                 name=f"kv-{self.name}-serve")
        try:
            leases.watch(self.lease_sums.started, self.lease_sums.ended)
        except NotImplementedError:   # no lease events: each offer sums its blocks itself
            pass
        self._own_threads = [serve, self.lease_sums.thread, *zap]
        self._threads = [*self._own_threads, *self.pool.threads]
        for t in self._own_threads:
            t.start()
        self.pool.start()
        return self.endpoint

    def _serve(self, sock: zmq.Socket, monitor: zmq.Socket, leases: LeaseView) -> None:
        decoder = msgspec.msgpack.Decoder(PullRequest | PullAck)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    ready = dict(poller.poll(200))
                    if monitor in ready:
                        for event in monitor_events(monitor):
                            self._warn.warning("handshake", "kv-%s: dropped a connection that "
                                               "failed the ZeroMQ handshake (%s)", self.name,
                                               zmq.Event(event).name)
                    if sock in ready:
                        self._handle(sock, sock.recv_multipart(copy=False), decoder, leases)
                except zmq.ContextTerminated:
                    return
                except Exception:   # one message's failure; the server goes on answering
                    logger.exception("kv-%s: failed to handle a message", self.name)
        finally:
            close_monitored(sock, monitor)

    def _handle(self, sock: zmq.Socket, frames: list, decoder, leases: LeaseView) -> None:
        # A DEALER's message arrives as [identity, payload]; a REQ adds an empty frame, and a
        # raw TCP peer's bytes read as ZeroMQ 1.0 frames of any number and content.
        if len(frames) != 2:
            self._warn.warning("frames", "kv-%s: dropped a message of %d frames (KV clients "
                               "send one)", self.name, len(frames) - 1)
            return
        ident, payload = frames
        try:
            msg = decoder.decode(payload.buffer)
        except msgspec.DecodeError:
            self._warn.warning("decode", "kv-%s: dropped an undecodable message of %d bytes",
                               self.name, len(payload))
            return
        if isinstance(msg, PullAck):
            if not leases.release(msg.ctx_request_id, msg.lease_token):
                self._warn.warning("ack", "kv-%s: dropped an ack for no live lease (unknown "
                                   "id or wrong token)", self.name)
            return
        sock.send_multipart([ident, *self._answer(msg, leases)], copy=False)

    def _answer(self, msg: PullRequest, leases: LeaseView) -> list:
        error, blocks = check_pull(leases, self.layout, msg)
        tokens = None
        if error is None and msg.want_tokens:
            tokens = leases.lookup_tokens(msg.ctx_request_id, msg.lease_token)
            if tokens is None:
                error = f"{msg.ctx_request_id!r} keeps no prompt tokens"
        if error is not None:
            return [msgspec.msgpack.encode(self.reply_type(ctx_request_id=msg.ctx_request_id,
                                                           error=error))]
        reply, frames = self._offer(msg.ctx_request_id, blocks)
        if self.faults is not None and reply.error is None:
            frames = self.faults.strike(frames)
        if tokens is not None and reply.error is None:   # the lease's array: never written
            reply.prompt_bytes = tokens.nbytes
            frames = [*frames, memoryview(np.ascontiguousarray(tokens, dtype="<i4"))]
        return [msgspec.msgpack.encode(reply), *frames]

    # -- GEN side -------------------------------------------------------------------------
    def pull(self, handle: KVHandle, dst_blocks: np.ndarray, done: Callable[[PullResult], None],
             skip: int = 0, with_tokens: bool = False) -> None:
        self.pool.submit(Job(handle, dst_blocks, done, skip, with_tokens))

    def _open_peer(self, endpoint: str) -> Peer:
        # A prompt's token frame holds at most as many tokens as this whole cache.
        max_tokens = self.kv_cache.shape[0] * self.kv_cache.shape[3]
        return Peer(self.ctx, endpoint, max(self._max_frame(), 4 * max_tokens), self.timeout,
                    self.connect_timeout, self.keys)

    def _pull_one(self, peer: Peer, job: Job) -> tuple[int, np.ndarray | None]:
        """(KV bytes copied, the prompt's token ids if asked for) of one pull."""
        handle, deadline = job.handle, time.monotonic() + self.timeout
        request = msgspec.msgpack.encode(PullRequest(
            handle.ctx_request_id, handle.lease_token, self.layout, job.skip + len(job.dst),
            handle.num_tokens, handle.prompt_digest, job.skip, job.with_tokens))
        if len(request) > MAX_REQUEST_BYTES:
            raise PullRefused(f"ctx_request_id is too long ({len(handle.ctx_request_id)} chars)")
        frames = peer.request(request, deadline, self.pool.stop)
        reply = self._read_reply(handle, frames)
        frames, tokens = frames[1:], None
        if job.with_tokens:
            tokens = _prompt_tokens(reply, frames, handle.num_tokens)
            frames = frames[:-1]
        nbytes = self._receive(handle, reply, frames, job.dst, deadline)
        peer.send(msgspec.msgpack.encode(PullAck(handle.ctx_request_id, handle.lease_token)))
        return nbytes, tokens

    def _read_reply(self, handle: KVHandle, frames: list):
        try:
            reply = msgspec.msgpack.decode(frames[0].buffer, type=self.reply_type)
        except msgspec.DecodeError as exc:
            raise BadReply(f"the context worker sent a malformed reply ({exc})") from None
        if reply.ctx_request_id != handle.ctx_request_id:
            raise BadReply(f"the context worker answered for {reply.ctx_request_id[:100]!r}, "
                           f"not {handle.ctx_request_id!r}")
        if reply.error is not None:
            if len(frames) != 1:
                raise BadReply(f"the context worker's error reply came with {len(frames) - 1} "
                               f"more frames")
            raise PullRefused(reply.error[:MAX_ERROR_CHARS])
        return reply

    def health(self) -> str | None:
        dead = [t.name for t in self._threads if not t.is_alive()]
        return f"KV transport threads stopped: {', '.join(dead)}" if dead else None

    def close(self) -> None:
        self._stop.set()
        self.pool.close()
        self.lease_sums.close()
        for t in self._own_threads:
            t.join(timeout=5)
        self.ctx.destroy(linger=0)


def _prompt_tokens(reply, frames: list, num_tokens: int) -> np.ndarray:
    """The prompt's int32 ids from the reply's last frame, checked for size before a KV byte
    is copied (their values are checked against the handle's prompt digest by the engine)."""
    size = 4 * num_tokens
    if reply.prompt_bytes != size or not frames or len(frames[-1]) != size:
        raise BadReply(f"the context worker sent {reply.prompt_bytes} bytes of prompt token ids "
                       f"in a frame of {len(frames[-1]) if frames else 0}, expected {size}")
    return np.frombuffer(frames[-1].buffer, dtype="<i4").astype(np.int32)
