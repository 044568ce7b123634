"""Paged attention in plain PyTorch.

The KV cache is one tensor, block-major: (num_blocks, num_layers, 2, block_size, kv_heads,
head_dim). Block-major keeps every block's KV for all layers in one contiguous span, so a
KV transfer moves a block with one memcpy-sized read.

The runner orders a step's tokens as [decode tokens | prefill chunk 1 | prefill chunk 2 ...].
Decodes (one query each) share one batched SDPA call over their gathered blocks; each prefill
chunk gets its own call, causal within the chunk and over all earlier context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int                       # first position of the chunk in its sequence
    length: int                      # query tokens in this chunk
    token_offset: int                # index of its first token in the step's flat batch
    block_table: torch.Tensor        # (1, n_blocks) long
    mask: torch.Tensor | None        # (1, 1, length, start + length) additive; None: causal, no past


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor        # (T,) long: block id each new token's KV goes to
    slot_offsets: torch.Tensor       # (T,) long: offset inside that block
    num_decodes: int
    decode_block_table: torch.Tensor | None   # (B_d, n_blocks) long
    decode_mask: torch.Tensor | None          # (B_d, 1, 1, n_blocks * block_size) additive
    prefills: list[PrefillChunk]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # SDPA turns a bool mask into an additive one on every call; do it once per step instead.
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def build_metadata(block_size: int, decode_seqs, prefill_seqs, sliding_window: int | None,
                   dtype: torch.dtype = torch.float32) -> AttentionMetadata:
    """decode_seqs: [(block_ids, position)], prefill_seqs: [(block_ids, start, length)].
    Positions are 0-based; a decode's query sits at `position`, its context is 0..position.
    Masks are additive (0 / -inf) in `dtype`, the dtype of the queries."""
    blocks, offsets = [], []
    for block_ids, pos in decode_seqs:
        blocks.append(block_ids[pos // block_size])
        offsets.append(pos % block_size)
    decode_table = decode_mask = None
    if decode_seqs:
        width = max(len(b) for b, _ in decode_seqs)
        table = [b + [0] * (width - len(b)) for b, _ in decode_seqs]
        decode_table = torch.tensor(table, dtype=torch.long)
        pos = torch.tensor([p for _, p in decode_seqs]).view(-1, 1)
        keys = torch.arange(width * block_size).view(1, -1)
        allowed = keys <= pos
        if sliding_window is not None:
            allowed &= keys > pos - sliding_window
        decode_mask = _additive(allowed.view(len(decode_seqs), 1, 1, -1), dtype)
    chunks, offset = [], len(decode_seqs)
    for block_ids, start, length in prefill_seqs:
        pos = torch.arange(start, start + length)
        blocks.extend(block_ids[p // block_size] for p in range(start, start + length))
        offsets.extend(p % block_size for p in range(start, start + length))
        n_blocks = (start + length + block_size - 1) // block_size
        mask = None
        if start > 0 or (sliding_window is not None and length > sliding_window):
            keys = torch.arange(start + length).view(1, -1)
            allowed = keys <= pos.view(-1, 1)
            if sliding_window is not None:
                allowed &= keys > pos.view(-1, 1) - sliding_window
            mask = _additive(allowed.view(1, 1, length, -1), dtype)
        chunks.append(PrefillChunk(start, length, offset,
                                   torch.tensor([block_ids[:n_blocks]], dtype=torch.long), mask))
        offset += length
    return AttentionMetadata(torch.tensor(blocks, dtype=torch.long),
                             torch.tensor(offsets, dtype=torch.long), len(decode_seqs),
                             decode_table, decode_mask, chunks)


def _gather(kv_cache: torch.Tensor, layer: int, table: torch.Tensor, length: int):
    """table (B, n) -> keys, values (B, KVH, length, D).

    index_select over whole blocks copies block_size * KVH * D contiguous values at a time;
    advanced indexing copies element by element and is 3-4x slower."""
    b, n = table.shape
    flat = table.view(-1)
    out = []
    for kv in (0, 1):
        x = kv_cache[:, layer, kv].index_select(0, flat)                # (B * n, bs, KVH, D)
        out.append(x.view(b, -1, *x.shape[2:])[:, :length].transpose(1, 2))
    return out


def paged_attention(q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor,
                    layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q (T, H, D) and kv (T, 2, KVH, D) for this step's tokens -> (T, H, D)."""
    kv_cache[meta.slot_blocks, layer, :, meta.slot_offsets] = kv     # keys and values at once
    nd = meta.num_decodes
    outs = []
    if nd:
        keys, vals = _gather(kv_cache, layer, meta.decode_block_table, meta.decode_mask.shape[-1])
        o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), keys, vals,   # (B, H, 1, D)
                                           attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
        outs.append(o.squeeze(2))
    for c in meta.prefills:
        s = slice(c.token_offset, c.token_offset + c.length)
        qc = q[s].transpose(0, 1).unsqueeze(0)                                 # (1, H, L, D)
        if c.mask is None:
            keys, vals = kv[s].permute(1, 2, 0, 3).unsqueeze(1)                 # (1, KVH, L, D) each
            o = F.scaled_dot_product_attention(qc, keys, vals, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            keys, vals = _gather(kv_cache, layer, c.block_table, c.start + c.length)
            o = F.scaled_dot_product_attention(qc, keys, vals, attn_mask=c.mask, scale=scale,
                                               enable_gqa=True)
        outs.append(o.squeeze(0).transpose(0, 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
