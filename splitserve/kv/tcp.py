"""The built-in KV transport: ZeroMQ over TCP, blocks sent straight from the KV cache.

CTX: the reply to a PullRequest is followed by one frame per block, each a zero-copy view of
the cache (the blocks are leased, so nothing writes them until GEN's PullAck releases the
lease), or on a GPU a copy of the blocks in pinned host memory (the platform's
blocks_to_host); the reply carries each block's checksum (summed as the lease started).
GEN: checks that the offer is exactly its blocks (count, checksums, and each frame exactly
one block's bytes; its socket refuses larger frames) and only then copies each frame into
its own blocks, checking its checksum as it goes (on a CPU the copy sums the frame in the same
pass; on a GPU the frame is summed, then copied through pinned staging buffers, in flight while
the next frame is read): a corrupted block fails the pull. The conversation itself is
kv.zmq_pull's.
"""

from __future__ import annotations

import numpy as np

from splitserve.kv.base import register
from splitserve.kv.checksums import SUM_BYTES, expected_sums, receive_block
from splitserve.kv.messages import MAX_REPLY_BYTES, TcpPullReply
from splitserve.kv.sockets import BadReply
from splitserve.kv.zmq_pull import ZmqPullTransport
from splitserve.protocol.engine import KVHandle


@register("tcp")
class TcpTransport(ZmqPullTransport):
    reply_type = TcpPullReply

    def _offer(self, ctx_request_id: str, blocks: np.ndarray) -> tuple[TcpPullReply, list]:
        frames = self.platform.blocks_to_host([self.block_bytes(b) for b in blocks.tolist()])
        return TcpPullReply(ctx_request_id=ctx_request_id, num_blocks=len(blocks),
                            block_sums=self.lease_sums.sums(ctx_request_id, blocks)), frames

    def _max_frame(self) -> int:
        # The reply carries at most the whole cache's block checksums.
        return max(self.block_nbytes, MAX_REPLY_BYTES + SUM_BYTES * self.kv_cache.shape[0])

    def _receive(self, handle: KVHandle, reply: TcpPullReply, frames: list, dst: np.ndarray,
                 deadline: float) -> int:
        if reply.num_blocks != len(dst) or len(frames) != len(dst):
            raise BadReply(f"the context worker offered {reply.num_blocks} KV blocks in "
                           f"{len(frames)} frames, expected {len(dst)}")
        size = self.block_nbytes
        for i, frame in enumerate(frames):
            if len(frame) != size:
                raise BadReply(f"KV block frame {i} holds {len(frame)} bytes, expected {size}")
        sums = expected_sums(reply.block_sums, len(dst))
        for i, (block, frame, want) in enumerate(zip(dst.tolist(), frames, sums)):
            receive_block(self.platform, i, frame.buffer, self.block_bytes(block), want)
        self.platform.finish_transfers()
        return len(dst) * size
