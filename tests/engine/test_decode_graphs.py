"""Decode graphs (engine/decode_graphs.py) on the CPU: the same buckets, padding, static
buffers and replays as on a GPU, where only the capture differs. Greedy decoding through
them gives eager decoding's tokens at batches that fill a capture size and batches that are
padded, and padding rows never touch a request's KV blocks."""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.config import EngineConfig
from splitserve.engine.decode_graphs import capture_sizes, padded_batch, padded_width
from splitserve.platforms.cpu import CpuPlatform


def test_capture_sizes_are_vllms():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(6) == (1, 2, 4, 6)
    assert capture_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    sizes = capture_sizes(32)
    assert [padded_batch(b, sizes) for b in (1, 3, 5, 8, 9, 32, 33)] == [1, 4, 8, 8, 16, 32, None]
    widths = [padded_width(n, 100) for n in range(1, 101)]
    assert sorted(set(widths)) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32,
                                   40, 48, 56, 64, 80, 96, 100]
    assert all(n <= w and (w - n) * 4 < w for n, w in enumerate(widths, 1))


def test_graphs_only_where_the_platform_captures_them():
    cpu = EngineConfig(device="cpu")
    assert cpu.graph_max_batch == 0          # the CPU has no launches to save
    with pytest.raises(ValueError, match="cuda_graph_max_batch must be >= 1"):
        EngineConfig(cuda_graph_max_batch=0)


def _llm(monkeypatch, backend: str, graphs: bool, max_batch: int = 8) -> LLM:
    monkeypatch.setenv("SPLITSERVE_ATTENTION", backend)
    # The CPU platform with decode graphs on: its capture keeps the forward and its replay
    # calls it again on the static buffers.
    monkeypatch.setattr(CpuPlatform, "decode_graphs", graphs)
    return LLM("tiny-random", device="cpu", dtype="float32", block_size=4, num_blocks=96,
               max_num_batched_tokens=64, max_num_seqs=8, seed=0,
               cuda_graph_max_batch=max_batch)


def _prompts(n: int) -> list[list[int]]:
    return [list(range(10 + 7 * i, 10 + 7 * i + 5 + 3 * i)) for i in range(n)]


def _decode(llm: LLM, batch: int):
    """Greedy tokens and logprobs of `batch` prompts whose sequences end one by one (the
    decode batch shrinks step by step)."""
    params = [SamplingParams(temperature=0, max_tokens=14 - i, logprobs=2, ignore_eos=True)
              for i in range(batch)]
    outs = [c for r in llm.generate(_prompts(batch), params) for c in r.outputs]
    logprobs = [lp.logprob for c in outs for lp in c.logprobs]
    return [c.token_ids for c in outs], torch.tensor(logprobs)


def _same_decoding(graphed: LLM, eager: LLM, tolerance: float) -> None:
    """Decode batches of 1 to 8 (3, 5, 6 and 7 padded up to 4 and 8) give eager tokens."""
    for batch in (1, 3, 5, 8):
        tokens, lps = _decode(graphed, batch)
        eager_tokens, eager_lps = _decode(eager, batch)
        assert tokens == eager_tokens
        assert (lps - eager_lps).abs().max().item() < tolerance


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_decode_graphs_give_eager_tokens(monkeypatch, backend):
    """Decode batches of 1 to 8 (3, 5, 6 and 7 padded up to 4 and 8) over 14 steps: the
    sequences' block tables grow past several widths, so several graphs are captured and
    replayed."""
    eager = _llm(monkeypatch, backend, graphs=False)
    graphed = _llm(monkeypatch, backend, graphs=True)
    assert eager.engine.runner.graphs is None
    _same_decoding(graphed, eager, 1e-4)
    shapes = set(graphed.engine.runner.graphs.graphs)
    assert {b for b, _ in shapes} == {1, 2, 4, 8}
    assert len({w for _, w in shapes}) >= 3
    # The same blocks in both engines hold the same KV: padding rows wrote only the scratch
    # block past the cache the block manager hands out.
    cache = graphed.engine.runner.kv_cache
    assert cache.shape == eager.engine.runner.kv_cache.shape
    assert (cache - eager.engine.runner.kv_cache).abs().max().item() < 1e-4
    scratch = graphed.engine.runner.graphs.kv_cache[-1]
    assert scratch.abs().sum().item() > 0


def test_larger_batches_and_prefills_run_eagerly(monkeypatch):
    eager = _llm(monkeypatch, "torch", graphs=False)
    graphed = _llm(monkeypatch, "torch", graphs=True, max_batch=4)
    tokens, lps = _decode(graphed, 6)
    eager_tokens, eager_lps = _decode(eager, 6)
    assert tokens == eager_tokens
    assert (lps - eager_lps).abs().max().item() < 1e-4
    # Six and five decodes ran eagerly, four and fewer as replays.
    assert {b for b, _ in graphed.engine.runner.graphs.graphs} == {1, 2, 4}


def test_a_shape_whose_capture_fails_runs_without_a_graph(monkeypatch, caplog):
    def refuse(platform, fn):
        raise RuntimeError("operation not permitted when stream is capturing")
    eager = _llm(monkeypatch, "torch", graphs=False)
    graphed = _llm(monkeypatch, "torch", graphs=True)
    monkeypatch.setattr(CpuPlatform, "capture_graph", refuse)
    tokens, _ = _decode(graphed, 3)
    assert tokens == _decode(eager, 3)[0]
    assert "capturing the decode graph of 4 sequences" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_give_eager_tokens():
    """The same on a GPU, where the graphs are CUDA graphs (float32: no bfloat16 ties)."""
    def llm(eager: bool) -> LLM:
        return LLM("tiny-random", device="cuda", dtype="float32", block_size=4, num_blocks=96,
                   max_num_batched_tokens=64, max_num_seqs=8, seed=0, enforce_eager=eager)
    graphed, eager = llm(False), llm(True)
    assert eager.engine.runner.graphs is None
    _same_decoding(graphed, eager, 1e-3)
    assert {b for b, _ in graphed.engine.runner.graphs.graphs} == {1, 2, 4, 8}
