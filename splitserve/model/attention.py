"""Paged attention in plain PyTorch.

The KV cache is one tensor, block-major: (num_blocks, num_layers, 2, block_size, kv_heads,
head_dim). Block-major keeps every block's KV for all layers in one contiguous span, so a
KV transfer moves a block with one memcpy-sized read.

The runner orders a step's tokens as [decode tokens | prefill chunk 1 | prefill chunk 2 ...].
Decodes (one query each) share one batched SDPA call over their gathered blocks; each prefill
chunk gets its own call, causal within the chunk and over all earlier context.

Two backends, chosen per engine by its platform (platforms/): `native` runs the C kernels
(model/native_attention.py) where they take the shape, these torch ops otherwise; `torch`
runs only the torch ops (gather whole blocks with index_select + SDPA), which work on any
device: a GPU's, or a CPU's under SPLITSERVE_ATTENTION=torch. Every tensor of the metadata
lives on the KV cache's device.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from splitserve.model import native_attention


@dataclass
class PrefillChunk:
    start: int                       # first position of the chunk in its sequence
    length: int                      # query tokens in this chunk
    token_offset: int                # index of its first token in the step's flat batch
    block_table: torch.Tensor        # (1, n_blocks) long
    sliding_window: int | None
    dtype: torch.dtype               # the queries'

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        """(1, 1, length, start + length) additive, or None: causal with no past. Built only
        for SDPA, on first use (the C kernel masks as it goes)."""
        length, end, window = self.length, self.start + self.length, self.sliding_window
        if self.start == 0 and (window is None or length <= window):
            return None
        allowed = _visible(torch.arange(self.start, end, device=self.block_table.device), end,
                           window)
        return _additive(allowed.view(1, 1, length, -1), self.dtype)


class GatherBuffer:
    """Grow-only scratch memory for a step's per-layer K/V gathers. Reused across layers and
    steps: a fresh multi-megabyte tensor per gather is memory the allocator hands back to
    the kernel on free and page-faults in again on the next layer."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self._buf = torch.empty(0, dtype=dtype, device=device)

    def take(self, *shape: int) -> torch.Tensor:
        n = math.prod(shape)
        if self._buf.numel() < n:
            self._buf = self._buf.new_empty(n)
        return self._buf[:n].view(shape)


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor        # (T,) long: block id each new token's KV goes to
    slot_offsets: torch.Tensor       # (T,) long: offset inside that block
    num_decodes: int
    decode_block_table: torch.Tensor | None   # (B_d, n_blocks) long
    decode_positions: torch.Tensor | None     # (B_d,) long
    prefills: list[PrefillChunk]
    scratch: GatherBuffer | None = None       # gathers go here; one layer's at a time
    sliding_window: int | None = None
    block_size: int = 16
    dtype: torch.dtype = torch.float32        # the queries'
    native: bool = True                       # the C kernels where they take the shape

    @functools.cached_property
    def decode_mask(self) -> torch.Tensor | None:
        """(B_d, 1, 1, n_blocks * block_size) additive: hides each decode's table padding
        (and what lies outside its window). Built only for SDPA, on first use (the C
        kernel reads positions instead)."""
        if self.decode_block_table is None:
            return None
        b, width = self.decode_block_table.shape
        allowed = _visible(self.decode_positions, width * self.block_size, self.sliding_window)
        return _additive(allowed.view(b, 1, 1, -1), self.dtype)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # SDPA turns a bool mask into an additive one on every call; do it once per step instead.
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf"))


def build_metadata(block_size: int, decode_seqs, prefill_seqs, sliding_window: int | None,
                   dtype: torch.dtype = torch.float32, scratch: GatherBuffer | None = None,
                   to_device=torch.from_numpy, native: bool = True) -> AttentionMetadata:
    """decode_seqs: [(block_ids, position)], prefill_seqs: [(block_ids, start, length)], where
    block_ids is the sequence's int64 array of blocks. Positions are 0-based; a decode's query
    sits at `position`, its context is 0..position. Masks are additive (0 / -inf) in `dtype`,
    the dtype of the queries. to_device: host array -> tensor on the KV cache's device (the
    platform's); native: the C kernels may run (the platform's attention backend)."""
    blocks, offsets = [], []            # (T_i,) int64 per group of new tokens, in step order
    decode_table = None
    if decode_seqs:
        pos = np.array([p for _, p in decode_seqs], dtype=np.int64)
        blocks.append(np.array([b[p // block_size] for b, p in decode_seqs], dtype=np.int64))
        offsets.append(pos % block_size)
        decode_table = to_device(_decode_table(decode_seqs))
    decode_pos = to_device(pos) if decode_seqs else None
    chunks, offset = [], len(decode_seqs)
    for block_ids, start, length in prefill_seqs:
        pos = np.arange(start, start + length)
        blocks.append(block_ids[pos // block_size])
        offsets.append(pos % block_size)
        table = to_device(block_ids[:(start + length + block_size - 1) // block_size])
        chunks.append(PrefillChunk(start, length, offset, table.view(1, -1), sliding_window, dtype))
        offset += length
    return AttentionMetadata(to_device(np.concatenate(blocks)), to_device(np.concatenate(offsets)),
                             len(decode_seqs), decode_table, decode_pos, chunks, scratch,
                             sliding_window, block_size, dtype, native)


def _visible(query_pos: torch.Tensor, num_keys: int, sliding_window: int | None) -> torch.Tensor:
    """(Q, num_keys) bool: which key positions each query position attends to."""
    keys = torch.arange(num_keys, device=query_pos.device).view(1, -1)
    query = query_pos.view(-1, 1)
    allowed = keys <= query
    if sliding_window is not None:
        allowed &= keys > query - sliding_window
    return allowed


def _decode_table(decode_seqs) -> np.ndarray:
    """Block table (B_d, n_blocks), padded with block 0 past each sequence's blocks (the
    decode mask hides the padding)."""
    width = max(len(b) for b, _ in decode_seqs)
    table = np.zeros((len(decode_seqs), width), dtype=np.int64)
    for row, (block_ids, _) in zip(table, decode_seqs):
        row[:len(block_ids)] = block_ids
    return table


def _gather(kv_cache: torch.Tensor, layer: int, table: torch.Tensor, length: int,
            scratch: GatherBuffer | None = None):
    """table (B, n) -> keys, values (B, KVH, length, D), views of `scratch` if given.

    index_select over whole blocks copies block_size * KVH * D contiguous values at a time;
    advanced indexing copies element by element and is 3-4x slower."""
    b, n = table.shape
    bs, kvh, d = kv_cache.shape[-3:]
    out = scratch.take(2, b * n, bs, kvh, d) if scratch else kv_cache.new_empty(2, b * n, bs, kvh, d)
    for kv in (0, 1):
        torch.index_select(kv_cache[:, layer, kv], 0, table.view(-1), out=out[kv])
    x = out.view(2, b, n * bs, kvh, d)[:, :, :length].transpose(2, 3)      # (2, B, KVH, L, D)
    return x[0], x[1]


def paged_attention(q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor,
                    layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q (T, H, D) and kv (T, 2, KVH, D) for this step's tokens -> (T, H, D)."""
    kv_cache[meta.slot_blocks, layer, :, meta.slot_offsets] = kv     # keys and values at once
    nd = meta.num_decodes
    outs = []
    o = None
    if nd and meta.native and native_attention.decode_usable(q):
        o = native_attention.decode(q[:nd], kv_cache, layer, meta.decode_block_table,
                                    meta.decode_positions, meta.sliding_window, scale)
        if o is not None:
            outs.append(o)
    if nd and o is None:
        keys, vals = _gather(kv_cache, layer, meta.decode_block_table, meta.decode_mask.shape[-1],
                             meta.scratch)
        # The query heads sharing a KV head go in as that head's query rows (their mask is the
        # same), so SDPA reads each gathered KV head once instead of once per query head.
        b, kvh, _, d = keys.shape
        o = F.scaled_dot_product_attention(q[:nd].view(b, kvh, -1, d), keys, vals,  # (B, KVH, G, D)
                                           attn_mask=meta.decode_mask, scale=scale)
        outs.append(o.reshape(nd, -1, d))
    native = bool(meta.prefills) and meta.native and native_attention.usable(q)
    for c in meta.prefills:
        s = slice(c.token_offset, c.token_offset + c.length)
        o = native_attention.prefill(q[s], kv_cache, layer, c.block_table, c.start,
                                     c.sliding_window, scale) if native else None
        if o is not None:
            outs.append(o)
            continue
        qc = q[s].transpose(0, 1).unsqueeze(0)                                 # (1, H, L, D)
        if c.mask is None:
            keys, vals = kv[s].permute(1, 2, 0, 3).unsqueeze(1)                 # (1, KVH, L, D) each
            o = F.scaled_dot_product_attention(qc, keys, vals, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            keys, vals = _gather(kv_cache, layer, c.block_table, c.start + c.length, meta.scratch)
            o = F.scaled_dot_product_attention(qc, keys, vals, attn_mask=c.mask, scale=scale,
                                               enable_gqa=True)
        outs.append(o.squeeze(0).transpose(0, 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
