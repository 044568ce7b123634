"""KV transfer between engine-core processes: what every backend provides.

GEN pulls, CTX serves. Each engine-core process owns one transport; its I/O runs on the
transport's own threads, never on a front-end event loop and never on the step thread.
The transport only moves bytes of whole KV blocks (and, asked to, the leased prompt's int32
ids): which blocks, and when they may be freed, is the engine's business
(splitserve/engine/kv_leases.py). A GEN that holds the first blocks of a lease already
(prefix cache hits) pulls only the rest: every backend takes `skip` (tcp and nixl offer
only the blocks after it; none moves nothing anyway). Block ids come from the
engine as int64 arrays that nobody writes in place.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from splitserve.kv import TRANSPORT_MODULES
from splitserve.kv.messages import PullRequest
from splitserve.model.config import ModelConfig
from splitserve.platforms import platform_for
from splitserve.platforms.base import Platform
from splitserve.protocol.engine import KVHandle


@dataclass(frozen=True)
class PullResult:
    ok: bool
    error: str | None = None
    nbytes: int = 0                      # KV bytes copied
    seconds: float = 0.0
    tokens: np.ndarray | None = None     # with_tokens: the prompt's int32 ids, as the CTX sent them


def layout_fingerprint(cfg: ModelConfig, dtype: torch.dtype, block_size: int) -> str:
    """Readable, so the log of a mismatch says what differs (clients are told less).

    The device is not in it: a block's bytes are the same on every device (the same dtype,
    the same block-major layout, little-endian), so a CPU CTX and a GPU GEN exchange KV over
    tcp, each side copying through its platform. A transport that cannot reach a device's
    memory refuses to start there instead (nixl on CUDA)."""
    return (f"{cfg.name}|{str(dtype).removeprefix('torch.')}|layers={cfg.num_layers}"
            f"|kv_heads={cfg.num_kv_heads}|head_dim={cfg.head_dim}|block={block_size}")


class LeaseView(abc.ABC):
    """What a transport may ask the engine about leased blocks (called from I/O threads).
    A lease answers only to its token: a wrong one is treated exactly like an unknown lease."""

    @abc.abstractmethod
    def lookup(self, ctx_request_id: str, lease_token: str,
               digest: str = "") -> tuple[np.ndarray, int] | None:
        """(block ids, num_tokens) of a live lease with this token (and, when both are set,
        this prompt digest), marked as being sent; None otherwise."""

    @abc.abstractmethod
    def release(self, ctx_request_id: str, lease_token: str) -> bool:
        """GEN has the bytes: the engine may free the blocks (it does so on its own thread).
        False if no live lease has this id and token (nothing is freed)."""

    def lookup_tokens(self, ctx_request_id: str, lease_token: str) -> np.ndarray | None:
        """The int32 token ids of the prompt a live lease (with this token) holds the KV of;
        None if there is no such lease or it keeps no tokens."""
        return None

    def watch(self, started: Callable[[str, np.ndarray], None],
              ended: Callable[[str], None]) -> None:
        """Call started(ctx_request_id, block ids) as a lease begins, before a pull can find
        it, and ended(ctx_request_id) as it ends, before its blocks are freed (both on the
        engine thread; ended must not raise). For a transport that exposes each lease's
        blocks on their own (nixl registers them)."""
        raise NotImplementedError(f"{type(self).__name__} does not report leases' ends")


def check_pull(leases: LeaseView, layout: str, msg: PullRequest) -> tuple[str | None, np.ndarray | None]:
    """(error, None) or (None, block ids to send: the lease's from msg.skip_blocks on) for a
    GEN's request to pull a lease: the same checks and words whichever backend serves it."""
    if msg.layout != layout:
        return ("KV layout mismatch: the context and generation workers differ in model, "
                "dtype or KV block size"), None
    lease = leases.lookup(msg.ctx_request_id, msg.lease_token, msg.prompt_digest)
    if lease is None:   # the same words for a wrong token or digest: no probing for lease ids
        return f"unknown or expired ctx_request_id {msg.ctx_request_id!r}", None
    blocks, num_tokens = lease
    if msg.num_tokens != num_tokens:
        return (f"prompt_len {msg.num_tokens} disagrees with the {num_tokens} tokens whose KV "
                f"{msg.ctx_request_id!r} holds"), None
    if len(blocks) != msg.num_blocks:
        return (f"the generation worker expects {msg.num_blocks} KV blocks but "
                f"{msg.ctx_request_id!r} holds {len(blocks)} ({num_tokens} tokens)"), None
    if not 0 <= msg.skip_blocks <= len(blocks):
        return f"skip_blocks {msg.skip_blocks} is not between 0 and {len(blocks)}", None
    return None, blocks[msg.skip_blocks:]


class KVTransport(abc.ABC):
    """One per engine-core process. `start` binds the serving side; `pull` copies remote
    blocks into local ones and calls `done` from a transport thread when finished."""

    name: str = ""

    def __init__(self, kv_cache: torch.Tensor, layout: str, platform: Platform | None = None):
        self.kv_cache = kv_cache     # (num_blocks, layers, 2, block_size, kv_heads, head_dim)
        self.layout = layout
        # The cache's device: how a block's bytes reach a socket and back (platforms/).
        self.platform = platform or platform_for("cpu")
        self.block_nbytes = kv_cache[0].numel() * kv_cache.element_size()

    @abc.abstractmethod
    def start(self, leases: LeaseView) -> str:
        """Start serving leased blocks; returns this engine's endpoint for KVHandles."""

    @abc.abstractmethod
    def pull(self, handle: KVHandle, dst_blocks: np.ndarray, done: Callable[[PullResult], None],
             skip: int = 0, with_tokens: bool = False) -> None:
        """Copy the handle's blocks from the skip-th on (the GEN has the first skip: prefix
        cache hits) into dst_blocks (int64, as many), then call done once. with_tokens: the
        prompt's token ids come too (PullResult.tokens), for a GEN given only its length."""

    def agent_metadata(self) -> bytes:
        return b""

    def health(self) -> str | None:
        """None while the transport can serve and pull; else what stopped (for /health)."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        ...

    def block_bytes(self, block_id: int) -> torch.Tensor:
        """A block's KV for all layers as a flat uint8 view: contiguous, no copy."""
        return self.kv_cache[block_id].view(-1).view(torch.uint8)


TRANSPORTS: dict[str, Callable[..., KVTransport]] = {}


def register(name: str):
    def deco(cls):
        cls.name = name
        TRANSPORTS[name] = cls
        return cls
    return deco


def make_transport(name: str, kv_cache: torch.Tensor, layout: str, **options) -> KVTransport:
    """The transport registered under `name` (kv/__init__.py lists them), built with the
    options it takes."""
    if name not in TRANSPORTS and name in TRANSPORT_MODULES:
        importlib.import_module(TRANSPORT_MODULES[name])
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(TRANSPORT_MODULES)}")
    return TRANSPORTS[name](kv_cache, layout, **options)
