"""Decode steps replayed from captured graphs (CUDA graphs on a GPU; vLLM's capture sizes).

A step whose rows are all single tokens (decodes), at most `max_batch` of them, runs as the
replay of a graph captured for its (batch, width) shape: the batch rounded up to the next
capture size (1, 2, 4, then every multiple of 8), the block table's width (blocks of the
longest sequence) up to the next of four widths per power of two (padded_width). A prefill,
a mixed step or a larger batch runs eagerly (runner.py). A shape is captured the first
time a step needs it, then replayed: the torch attention backend gathers whole block
tables, so the width is part of the shape, and capturing every (batch, width) pair at
start would capture hundreds of graphs.

A graph reads its inputs from one static device buffer at fixed addresses. Each step fills
a host copy of it and sends it in one copy: per row its token id, position, KV slot (block,
offset) and block table. Rows past the batch (padding) decode token 0 at position 0 into the
scratch block (the KV cache's last, which the block manager never hands out) and are dropped.
Table entries past a sequence's blocks also name the scratch block; the decode mask hides them.

Everything here is device-generic: only `Platform.capture_graph` differs. CUDA records the
kernels once and replays them; the CPU's "replay" calls the same forward again on the same
buffers, which is how the tests check this path against eager steps.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch

from splitserve.engine.request import Request
from splitserve.model.attention import AttentionMetadata
from splitserve.model.llama import LlamaModel
from splitserve.platforms.base import Platform

logger = logging.getLogger(__name__)

ROWS = 4    # per-row int64 fields ahead of the block table: id, position, slot block, offset


def capture_sizes(max_batch: int) -> tuple[int, ...]:
    """vLLM's: 1, 2, 4, then every multiple of 8 up to max_batch, and max_batch itself."""
    sizes = [b for b in (1, 2, 4) if b <= max_batch] + list(range(8, max_batch + 1, 8))
    return tuple(sizes if sizes[-1] == max_batch else sizes + [max_batch])


def padded_batch(batch: int, sizes: tuple[int, ...]) -> int | None:
    """The capture size a batch is padded up to; None: larger than every one."""
    return next((b for b in sizes if b >= batch), None)


def padded_width(blocks: int, max_width: int) -> int:
    """The block-table width a graph is captured for, at most max_width (the blocks of
    max_model_len): 1 to 8 as they are, then four widths per power of two (10, 12, 14, 16,
    20, 24, ...). A padded column costs a gathered block per row and layer, so padding stays
    under a quarter of the width; coarser buckets would capture fewer graphs but read more."""
    step = 1 << max((blocks - 1).bit_length() - 3, 0)
    return min(-(-blocks // step) * step, max_width)


class DecodeGraphs:
    """Owns the static input buffers and the captured graphs of one runner's decode steps.

    kv_cache: the runner's whole cache, its last block the padding rows' scratch block.
    Graph outputs are (padded batch, hidden) final hidden states; run() returns the rows of
    the step's requests."""

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int,
                 max_batch: int, max_width: int, native_attention: bool, platform: Platform):
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.native_attention, self.platform = native_attention, platform
        assert max_batch >= 1 and max_width >= 1, (max_batch, max_width)
        self.sizes = capture_sizes(max_batch)
        self.max_width = max_width
        self.scratch_block = kv_cache.shape[0] - 1
        numel = max_batch * (ROWS + max_width)
        self.host = platform.host_buffer(numel, torch.int64)
        self.static = torch.zeros(numel, dtype=torch.int64, device=platform.device)
        self.graphs: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}

    def describe(self) -> str:
        """The start line's words."""
        return f", decode steps of up to {self.sizes[-1]} sequences replay graphs"

    def run(self, scheduled: dict[Request, int]) -> torch.Tensor | None:
        """(len(scheduled), hidden) final hidden states, or None: not a step a graph runs
        (a row of more than one token, or more rows than the largest capture size)."""
        batch = padded_batch(len(scheduled), self.sizes)
        if batch is None or any(n != 1 for n in scheduled.values()):
            return None
        blocks = max(-(-(r.num_computed_tokens + 1) // self.block_size) for r in scheduled)
        shape = (batch, padded_width(blocks, self.max_width))
        self._fill(scheduled, *shape)
        graph = self.graphs.get(shape)
        if graph is None:   # captured on the step's own inputs: its warm-up is this step
            graph = self.graphs[shape] = self._capture(*shape)
        return graph()[:len(scheduled)]

    def _capture(self, batch: int, width: int) -> Callable[[], torch.Tensor]:
        """A failed capture (an operation the device cannot record) leaves that shape eager,
        said once, rather than failing every decode step that has it."""
        forward = functools.partial(self._forward, batch, width)
        try:
            return self.platform.capture_graph(forward)
        except RuntimeError:
            logger.exception("engine: capturing the decode graph of %d sequences x %d blocks "
                             "failed; that shape runs without one", batch, width)
            return forward

    def _views(self, buffer: torch.Tensor, batch: int, width: int):
        """-> ids, positions, slot blocks, slot offsets (batch,) and the table (batch, width):
        one layout for the host copy and the static buffer."""
        rows = buffer[:ROWS * batch].reshape(ROWS, batch)
        table = buffer[ROWS * batch:(ROWS + width) * batch].reshape(batch, width)
        return rows[0], rows[1], rows[2], rows[3], table

    def _fill(self, scheduled: dict[Request, int], batch: int, width: int) -> None:
        """The step's inputs, padded, into the host copy, then into the static buffer. The
        host copy is rewritten only by the next step, after this one's sampled tokens reached
        the host: its copy to the device has landed by then."""
        host = self.host.numpy()
        ids, positions, slot_blocks, slot_offsets, table = self._views(host, batch, width)
        reqs, bs = list(scheduled), self.block_size
        pos = [r.num_computed_tokens for r in reqs]
        ids[:], positions[:], slot_offsets[:] = 0, 0, 0
        slot_blocks[:], table[:] = self.scratch_block, self.scratch_block
        ids[:len(reqs)] = [r.token_slice(p, p + 1)[0] for r, p in zip(reqs, pos)]
        positions[:len(reqs)] = pos
        slot_blocks[:len(reqs)] = [r.block_ids[p // bs] for r, p in zip(reqs, pos)]
        slot_offsets[:len(reqs)] = positions[:len(reqs)] % bs
        for row, req in zip(table, reqs):
            blocks = req.block_ids[:width]
            row[:len(blocks)] = blocks
        n = (ROWS + width) * batch
        self.static[:n].copy_(self.host[:n], non_blocking=True)

    def _forward(self, batch: int, width: int) -> torch.Tensor:
        """The model's decode forward on the static buffer's views: the metadata is built
        here, inside what a graph records, so the decode mask follows the positions."""
        ids, positions, slot_blocks, slot_offsets, table = self._views(self.static, batch, width)
        cfg = self.model.cfg
        meta = AttentionMetadata(slot_blocks, slot_offsets, batch, table, positions, [],
                                 sliding_window=cfg.sliding_window, block_size=self.block_size,
                                 dtype=self.kv_cache.dtype, native=self.native_attention)
        return self.model(ids, positions, self.kv_cache, meta)
