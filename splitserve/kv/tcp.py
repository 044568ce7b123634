"""The built-in KV transport: ZeroMQ over TCP, blocks sent straight from the KV cache.

CTX: the reply to a PullRequest is followed by one frame per block, each a zero-copy view of
the cache (the blocks are leased, so nothing writes them until GEN's PullAck releases the
lease). GEN: copies each frame into its own blocks. The conversation itself is
kv.zmq_pull's.
"""

from __future__ import annotations

import msgspec
import numpy as np

from splitserve.kv.base import register
from splitserve.kv.messages import TcpPullReply
from splitserve.kv.zmq_pull import ZmqPullTransport
from splitserve.protocol.engine import KVHandle


@register("tcp")
class TcpTransport(ZmqPullTransport):
    reply_type = TcpPullReply

    def _offer(self, blocks: np.ndarray) -> list:
        frames = [memoryview(self.block_bytes(b).numpy()) for b in blocks.tolist()]
        return [msgspec.msgpack.encode(TcpPullReply(num_blocks=len(blocks))), *frames]

    def _receive(self, handle: KVHandle, reply: TcpPullReply, frames: list, dst: np.ndarray,
                 deadline: float) -> int:
        if len(frames) != len(dst):
            raise RuntimeError(f"expected {len(dst)} KV blocks, received {len(frames)}")
        nbytes = 0
        for block, frame in zip(dst.tolist(), frames):
            src = np.frombuffer(frame.buffer, dtype=np.uint8)
            self.block_bytes(block).numpy()[:] = src   # one memcpy per block
            nbytes += src.size
        return nbytes
