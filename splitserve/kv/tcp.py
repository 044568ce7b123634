"""The built-in KV transport: ZeroMQ over TCP, blocks sent straight from the KV cache.

CTX: a ROUTER socket answers a PullRequest with one reply frame followed by one frame per
block, each a zero-copy view of the cache (the blocks are leased, so nothing writes them
until GEN's PullAck releases the lease). GEN: one thread runs pulls one after another and
copies each frame into its own blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import msgspec
import numpy as np
import torch
import zmq

from splitserve.kv.base import KVTransport, LeaseView, PullResult, check_pull, register
from splitserve.protocol.engine import KVHandle

logger = logging.getLogger(__name__)


class PullRequest(msgspec.Struct, tag="pull"):
    ctx_request_id: str
    layout: str
    num_blocks: int


class PullAck(msgspec.Struct, tag="ack"):
    ctx_request_id: str


class PullReply(msgspec.Struct):
    error: str | None = None
    num_blocks: int = 0


@register("tcp")
class TcpTransport(KVTransport):
    def __init__(self, kv_cache: torch.Tensor, layout: str, host: str = "127.0.0.1",
                 port: int = 0, timeout: float = 30.0):
        super().__init__(kv_cache, layout)
        self.host, self.port, self.timeout = host, port, timeout
        self.ctx = zmq.Context()
        self.jobs: queue.Queue = queue.Queue()
        self.endpoint = ""
        self._stop = threading.Event()

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
        threading.Thread(target=self._serve, args=(sock, leases), daemon=True, name="kv-serve").start()
        threading.Thread(target=self._pull_loop, daemon=True, name="kv-pull").start()
        return self.endpoint

    def _serve(self, sock: zmq.Socket, leases: LeaseView) -> None:
        decoder = msgspec.msgpack.Decoder(PullRequest | PullAck)
        encode = msgspec.msgpack.encode
        while not self._stop.is_set():
            if not sock.poll(200):
                continue
            ident, payload = sock.recv_multipart()
            try:
                msg = decoder.decode(payload)
            except msgspec.DecodeError:
                logger.warning("kv: dropped an undecodable message")
                continue
            if isinstance(msg, PullAck):
                leases.release(msg.ctx_request_id)
                continue
            error, blocks = check_pull(leases, self.layout, msg.ctx_request_id, msg.layout,
                                       msg.num_blocks)
            if error is not None:
                sock.send_multipart([ident, encode(PullReply(error=error))])
                continue
            frames = [memoryview(self.block_bytes(b).numpy()) for b in blocks]
            sock.send_multipart([ident, encode(PullReply(num_blocks=len(blocks))), *frames], copy=False)

    # -- GEN side -------------------------------------------------------------------------
    def pull(self, handle: KVHandle, dst_blocks: list[int], done: Callable[[PullResult], None]) -> None:
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
                nbytes = self._pull_one(socks, handle, dst)
                result = PullResult(True, nbytes=nbytes, seconds=time.perf_counter() - t0)
            except Exception as exc:   # any failure ends this request, never the thread
                result = PullResult(False, error=str(exc), seconds=time.perf_counter() - t0)
            done(result)

    def _pull_one(self, socks: dict, handle: KVHandle, dst: list[int]) -> int:
        sock = socks.get(handle.endpoint)
        if sock is None:
            sock = socks[handle.endpoint] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(handle.endpoint)
        sock.send(msgspec.msgpack.encode(PullRequest(handle.ctx_request_id, self.layout, len(dst))))
        if not sock.poll(int(self.timeout * 1000)):
            sock.close()   # a late reply must not be read as the answer to the next pull
            del socks[handle.endpoint]
            raise TimeoutError(f"context worker KV server {handle.endpoint} did not answer "
                               f"within {self.timeout:.0f} s")
        frames = sock.recv_multipart(copy=False)
        reply = msgspec.msgpack.decode(frames[0].buffer, type=PullReply)
        if reply.error is not None:
            raise RuntimeError(reply.error)
        nbytes = 0
        if len(frames) - 1 != len(dst):
            raise RuntimeError(f"expected {len(dst)} KV blocks, received {len(frames) - 1}")
        for block, frame in zip(dst, frames[1:]):
            src = np.frombuffer(frame.buffer, dtype=np.uint8)
            self.block_bytes(block).numpy()[:] = src   # one memcpy per block
            nbytes += src.size
        sock.send(msgspec.msgpack.encode(PullAck(handle.ctx_request_id)))
        return nbytes

    def close(self) -> None:
        self._stop.set()
        time.sleep(0.3)
        self.ctx.destroy(linger=0)
