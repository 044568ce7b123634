"""What GEN and CTX say to each other to pull a lease's KV (msgpack over ZeroMQ).

GEN -> CTX: a PullRequest, and a PullAck once the bytes are in its own blocks. CTX -> GEN:
one reply per PullRequest; `error` set means nothing is offered. Both ends of a pull run the
same backend, so each backend's reply type is read only by that backend. A reply names the
lease it answers, so the GEN never takes an answer to another pull for its own, and a
checksum of every block it offers (kv/checksums.py), so the GEN decodes no corrupted block.
A request and an ack carry the lease's token (KVHandle.lease_token): the lease id alone
opens nothing.
"""

from __future__ import annotations

import msgspec

# The largest message a CTX's KV server takes (a PullRequest or PullAck is a few hundred
# bytes); a larger one makes ZeroMQ drop the sender's connection.
MAX_REQUEST_BYTES = 64 << 10
# The largest reply frame a GEN takes besides block frames (error text included).
MAX_REPLY_BYTES = 64 << 10
# A NIXL agent's metadata is a few hundred bytes over UCX/TCP; RDMA adds keys per device.
MAX_AGENT_METADATA_BYTES = 1 << 20


class PullRequest(msgspec.Struct, tag="pull"):
    ctx_request_id: str
    lease_token: str
    layout: str         # the GEN's kv.base.layout_fingerprint(): must equal the CTX's
    num_blocks: int     # blocks the GEN allocated for the prompt
    num_tokens: int     # the GEN's prompt_len: must equal the lease's
    prompt_digest: str = ""   # the handle's: must equal the lease's (when both are set)
    # The GEN has the first skip_blocks of the lease's blocks already (prefix cache hits):
    # it is offered the rest only.
    skip_blocks: int = 0
    want_tokens: bool = False   # also send the prompt's int32 token ids (a last frame)


class PullAck(msgspec.Struct, tag="ack"):
    """The GEN has the bytes: the CTX may free the lease's blocks."""
    ctx_request_id: str
    lease_token: str


class TcpPullReply(msgspec.Struct):
    """Followed by num_blocks frames, one block's bytes each (then the prompt's frame)."""
    ctx_request_id: str = ""
    error: str | None = None
    num_blocks: int = 0
    prompt_bytes: int = 0         # want_tokens: the size of the last frame, the prompt's ids
    block_sums: bytes = b""       # kv.checksums: 8 bytes per offered block, in frame order


class NixlPullReply(msgspec.Struct):
    """Where the blocks are, for the GEN's NIXL agent to read them."""
    ctx_request_id: str = ""
    error: str | None = None
    agent_name: str = ""
    agent_metadata: bytes = b""
    base_addr: int = 0            # the CTX's KV cache: block b starts at base + b * block_bytes
    block_bytes: int = 0
    block_ids: list[int] = []
    prompt_bytes: int = 0         # want_tokens: the size of the one frame after the reply
    block_sums: bytes = b""       # kv.checksums: 8 bytes per block of block_ids, in order
