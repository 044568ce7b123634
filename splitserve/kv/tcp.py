"""The built-in KV transport: ZeroMQ over TCP, blocks sent straight from the KV cache.

CTX: the reply to a PullRequest is followed by one frame per block, each a zero-copy view of
a CPU cache (the blocks are leased, so nothing writes them until GEN's PullAck releases the
lease) or a GPU block's copy in pinned host memory (the platform's blocks_to_host). GEN: checks that the offer is exactly its blocks (count, and each frame exactly one
block's bytes; its socket refuses larger frames) and only then copies each frame into its
own blocks (on a GPU through pinned staging buffers, the copies in flight while the next
frame is read). The conversation itself is kv.zmq_pull's.
"""

from __future__ import annotations

import numpy as np

from splitserve.kv.base import register
from splitserve.kv.messages import MAX_REPLY_BYTES, TcpPullReply
from splitserve.kv.sockets import BadReply
from splitserve.kv.zmq_pull import ZmqPullTransport
from splitserve.protocol.engine import KVHandle


@register("tcp")
class TcpTransport(ZmqPullTransport):
    reply_type = TcpPullReply

    def _offer(self, ctx_request_id: str, blocks: np.ndarray) -> tuple[TcpPullReply, list]:
        frames = self.platform.blocks_to_host([self.block_bytes(b) for b in blocks.tolist()])
        return TcpPullReply(ctx_request_id=ctx_request_id, num_blocks=len(blocks)), frames

    def _max_frame(self) -> int:
        return max(self.block_nbytes, MAX_REPLY_BYTES)

    def _receive(self, handle: KVHandle, reply: TcpPullReply, frames: list, dst: np.ndarray,
                 deadline: float) -> int:
        if reply.num_blocks != len(dst) or len(frames) != len(dst):
            raise BadReply(f"the context worker offered {reply.num_blocks} KV blocks in "
                           f"{len(frames)} frames, expected {len(dst)}")
        size = self.block_nbytes
        for i, frame in enumerate(frames):
            if len(frame) != size:
                raise BadReply(f"KV block frame {i} holds {len(frame)} bytes, expected {size}")
        for block, frame in zip(dst.tolist(), frames):
            self.platform.host_to_block(frame.buffer, self.block_bytes(block))
        self.platform.finish_transfers()
        return len(dst) * size
