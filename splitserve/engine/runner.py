"""Model runner: turns a scheduled batch into tensors, runs the model, returns logits.

Owns the KV cache tensor, on the platform's device (platforms/). Nothing here decides what to
run (scheduler) or what to do with the logits (sampler); it only gathers token ids, positions
and block tables, and hands them to the device. Decode steps replay captured graphs where the
engine turned them on (decode_graphs.py); every other step runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from splitserve.engine.decode_graphs import DecodeGraphs
from splitserve.engine.request import Request
from splitserve.model.attention import GatherBuffer, build_metadata
from splitserve.model.config import ModelConfig
from splitserve.model.llama import LlamaModel
from splitserve.platforms import platform_for
from splitserve.platforms.base import Platform


@dataclass
class StepResult:
    sample_requests: list[Request]             # requests whose last scheduled token is their last
    logits: torch.Tensor | None                # (len(sample_requests), V) float32
    # request -> (first position covered, logits (n, V)) for prompt-logprob requests
    prompt_logits: dict[int, tuple[Request, int, torch.Tensor]] = field(default_factory=dict)


class ModelRunner:
    """graph_max_batch: decode steps of at most this many rows replay captured graphs (0:
    every step eager); max_width: the blocks of the longest sequence (max_model_len), what
    the graphs' block tables hold at most."""

    def __init__(self, model: LlamaModel, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, platform: Platform | None = None,
                 graph_max_batch: int = 0, max_width: int = 0):
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        self.platform = platform or platform_for("cpu")
        self.native_attention = self.platform.attention_backend() == "native"
        # (num_blocks, layers, k|v, block_size, kv_heads, head_dim); see model/attention.py.
        # With graphs, one more block at the end: the padding rows' scratch, never handed out.
        scratch = 1 if graph_max_batch else 0
        cache = self.platform.alloc_kv_cache(
            (num_blocks + scratch, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim),
            dtype)
        self.kv_cache = cache[:num_blocks]      # what the block manager and KV transfer see
        self.graphs = DecodeGraphs(model, cache, block_size, graph_max_batch, max_width,
                                   self.native_attention, self.platform) if scratch else None
        self.gather_buffer = GatherBuffer(dtype, self.platform.device)

    def __del__(self):
        # Helper threads may still read the weights and this KV cache, freed once this returns.
        self.platform.quiesce()

    @staticmethod
    def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return block_size * cfg.kv_bytes_per_token(torch.finfo(dtype).bits // 8)

    def copy_block(self, src: int, dst: int) -> None:
        self.kv_cache[dst] = self.kv_cache[src]

    @torch.inference_mode()
    def execute(self, scheduled: dict[Request, int]) -> StepResult:
        """scheduled: request -> its number of new tokens, single-token rows first
        (SchedulerOutput.scheduled)."""
        hidden = self.graphs.run(scheduled) if self.graphs else None
        if hidden is None:
            hidden = self._eager(scheduled)
        return self._logits(scheduled, hidden)

    def _eager(self, scheduled: dict[Request, int]) -> torch.Tensor:
        """-> final hidden states (T, hidden) of every scheduled token."""
        ids, positions, decodes, prefills = [], [], [], []
        for req, n in scheduled.items():
            start = req.num_computed_tokens
            ids.append(req.token_slice(start, start + n))
            positions.append(np.arange(start, start + n, dtype=np.int64))
            if n == 1:
                decodes.append((req.block_ids, start))
            else:
                prefills.append((req.block_ids, start, n))
        meta = build_metadata(self.block_size, decodes, prefills, self.cfg.sliding_window,
                              self.kv_cache.dtype, self.gather_buffer, self.platform.to_device,
                              self.native_attention)
        to_device = self.platform.to_device
        return self.model(to_device(np.concatenate(ids).astype(np.int64)),
                          to_device(np.concatenate(positions)), self.kv_cache, meta)

    def _logits(self, scheduled: dict[Request, int], hidden: torch.Tensor) -> StepResult:
        rows, sample_requests, prompt_logits, offset = [], [], {}, 0
        for req, n in scheduled.items():
            start = req.num_computed_tokens
            if start + n == req.num_tokens:
                rows.append(offset + n - 1)
                sample_requests.append(req)
            if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                # Position p scores prompt token p + 1; the prompt's last position scores
                # the first generated token instead, which is not a prompt logprob.
                end = min(start + n, req.num_prompt_tokens - 1)
                prompt_logits[id(req)] = (req, start, self.model.logits(hidden[offset:offset + end - start]))
            offset += n
        # rows rise within the step's tokens: as many as the tokens is all of them in order
        # (decodes only), and then no index goes to the device
        sampled = hidden if len(rows) == len(hidden) else hidden[rows]
        logits = self.model.logits(sampled) if rows else None
        return StepResult(sample_requests, logits, prompt_logits)
