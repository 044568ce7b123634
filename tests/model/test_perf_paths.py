"""The fast paths against the naive ones: fused RMSNorm, three-kernel RoPE, block gathers,
dtype="auto", and the fp16 / int8 quantized linears (tests/support/reference_model.py is the yardstick)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from reference_model import ReferenceModel, rms_norm, rope_cos_sin, rotate_half
from splitserve.config import QUANTIZATIONS, CacheConfig, EngineConfig, SchedulerConfig
from splitserve.engine.core import EngineCore
from splitserve.model.attention import _gather, build_metadata
from splitserve.model.config import RopeScaling
from splitserve.model import fused
from splitserve.model.llama import RMSNorm, Rotary, build_model
from splitserve.model.loader import ModelSource
from splitserve.model.native_linear import NativeLinear
from splitserve.model.packed import PackedLinear, RowSplitLinear, packing_supported
from splitserve.model.quant import quantization_supported
from splitserve.sampling_params import SamplingParams
from splitserve.tokens import PromptTokens
from engine_requests import add_request, greedy_tokens

QUANTS = [pytest.param(q, marks=pytest.mark.skipif(not quantization_supported(q),
                                                   reason="no FBGEMM in this torch"))
          for q in QUANTIZATIONS]


# -- dtype="auto" -------------------------------------------------------------------------
def test_auto_dtype_resolves_to_a_concrete_dtype():
    assert EngineConfig().dtype == "auto"
    assert EngineConfig(dtype="auto").torch_dtype in (torch.float32, torch.bfloat16)
    assert EngineConfig(dtype="float32").torch_dtype == torch.float32
    assert EngineConfig(dtype="bfloat16").torch_dtype == torch.bfloat16


def test_auto_dtype_is_float32_where_torch_runs_avx2():
    """An AVX512-BF16 CPU whose PyTorch and oneDNN are held to AVX2 (what an AVX2-only
    machine runs) computes bfloat16 in software: auto must not pick it."""
    code = ("import torch; from splitserve.platforms.cpu import auto_dtype; "
            "print(torch.backends.cpu.get_cpu_capability(), auto_dtype())")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["AVX2", "torch.float32"]


@pytest.mark.parametrize("quant", QUANTS)
def test_quantization_computes_in_float32(quant):
    assert EngineConfig(quantization=quant).torch_dtype == torch.float32
    with pytest.raises(ValueError, match="float32"):
        EngineConfig(dtype="bfloat16", quantization=quant)


def test_unknown_quantization_is_rejected():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")


# -- RMSNorm, RoPE, gathers against the naive forms -----------------------------------------
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 0)])
def test_rms_norm_matches_reference(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 64, generator=gen) * 3).to(dtype)
    norm = RMSNorm(64, 1e-5).to(dtype)
    norm.weight.data = torch.randn(64, generator=gen).to(dtype)
    with torch.no_grad():
        torch.testing.assert_close(norm(x), rms_norm(x, norm.weight, 1e-5), atol=tol, rtol=tol)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("scaling", [None, RopeScaling(8.0, 1.0, 4.0, 64)])
def test_rope_matches_rotate_half(tiny_source, scaling, native, monkeypatch):
    monkeypatch.setattr(fused, "_native", lambda x: native and fused._lib() is not None)
    cfg = dataclasses.replace(tiny_source.config, rope_scaling=scaling)
    rotary = Rotary(cfg)
    positions = torch.tensor([0, 1, 5, 99, 4000])
    x = torch.randn(len(positions), cfg.num_heads, cfg.head_dim)               # (T, H, D)
    freqs = positions.float()[:, None] * rotary.inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)                      # (T, 1, D)
    expected = x * emb.cos() + rotate_half(x) * emb.sin()
    got = x.clone()
    fused.rope_(got, *rotary.cos_sin(positions, torch.float32))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    # and the frequencies are the reference's (to float32 rounding at large positions)
    cos, _ = rope_cos_sin(cfg, positions)
    torch.testing.assert_close(emb.cos().squeeze(1), cos, atol=5e-4, rtol=0)


def test_gather_returns_each_sequences_blocks_in_order():
    cache = torch.randn(10, 3, 2, 4, 2, 8)           # (blocks, layers, k|v, block, KVH, D)
    table = torch.tensor([[3, 7, 1], [9, 2, 0]])
    keys, vals = _gather(cache, 1, table, 10)
    for b in range(2):
        for kv, got in ((0, keys), (1, vals)):
            want = torch.cat([cache[i, 1, kv] for i in table[b]])[:10].transpose(0, 1)
            assert torch.equal(got[b], want)


def test_decode_mask_is_additive_in_the_query_dtype():
    meta = build_metadata(4, [(np.array([0, 1]), 5)], [], None, torch.bfloat16)
    assert meta.decode_mask.dtype == torch.bfloat16
    assert meta.decode_mask[0, 0, 0].tolist() == [0.0] * 6 + [float("-inf")] * 2


# -- the rewritten attention on the architectures' less common paths --------------------------
def _variant(tiny_source, **changes) -> ModelSource:
    """tiny-random with a changed config; q/k/v biases added when attention_bias is set."""
    cfg = dataclasses.replace(tiny_source.config, **changes)

    def weights():
        gen = torch.Generator().manual_seed(3)
        for name, tensor in tiny_source.weights():
            yield name, tensor
            if cfg.attention_bias and name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                yield name.replace("weight", "bias"), torch.randn(tensor.shape[0], generator=gen) * 0.1

    return ModelSource(cfg, tiny_source.tokenizer, weights)


@pytest.mark.parametrize("changes", [
    {"architecture": "mistral", "sliding_window": 6},
    {"architecture": "qwen2", "attention_bias": True},
    {"rope_scaling": RopeScaling(8.0, 1.0, 4.0, 16)},
], ids=["sliding-window", "qkv-bias", "llama3-rope"])
def test_engine_greedy_matches_reference_on_variants(tiny_source, changes):
    source = _variant(tiny_source, **changes)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 49152, n).astype(np.int32) for n in (3, 17, 30)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reference = ReferenceModel(source)
    want = [reference.greedy(p.tolist(), 10) for p in prompts]
    assert _greedy(source, None, prompts, params, budget=7) == want   # 7: chunked prefills


# -- quantized weights -------------------------------------------------------------------
# fp16 weights are near-lossless. int8 is lossy by design (FBGEMM quantizes activations to
# 7 bits per call, see model/quant.py); these bounds hold with margin on tiny-random, whose
# flat logits make it a hard case for top-1 agreement.
TOLERANCES = [("fp16", 2e-3, 1.0), ("int8", 0.12, 0.7)]


def _logits(model, cfg, ids):
    """Teacher-forced (T, V) logits of one sequence through the paged model."""
    n_blocks = (len(ids) + 3) // 4
    meta = build_metadata(4, [], [(np.arange(n_blocks), 0, len(ids))], None)
    kv = torch.zeros(n_blocks, cfg.num_layers, 2, 4, cfg.num_kv_heads, cfg.head_dim)
    return model.logits(model(torch.tensor(ids), torch.arange(len(ids)), kv, meta))


@pytest.mark.parametrize("quant, max_rel_err, min_top1", TOLERANCES)
def test_quantized_logits_close_to_reference(tiny_source, quant, max_rel_err, min_top1):
    if not quantization_supported(quant):
        pytest.skip("no FBGEMM in this torch")
    cfg, reference = tiny_source.config, ReferenceModel(tiny_source)
    model = build_model(cfg, tiny_source.weights(), torch.float32, quantization=quant)
    for seed in range(3):
        prompt = np.random.default_rng(seed).integers(3, cfg.vocab_size, 8).tolist()
        ids = prompt + reference.greedy(prompt, 24)
        ref, got = reference.logits(ids), _logits(model, cfg, ids)          # (T, V)
        rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
        assert rel.max() < max_rel_err
        top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert top1 >= min_top1


@pytest.mark.parametrize("quant", QUANTS)
def test_quantized_engine_greedy_starts_like_float32(tiny_source, quant):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 49152, n).astype(np.int32) for n in (3, 11, 26, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want, got = (_greedy(tiny_source, q, prompts, params) for q in (None, quant))
    if quant == "fp16":
        assert got == want
    else:   # once one token differs the contexts differ; the first token shares its context
        assert [g[0] for g in got] == [w[0] for w in want]


# -- packed (oneDNN blocked) weights -----------------------------------------------------
# float32 on one thread is laid out for the C kernel instead (tests/model/test_native_linear.py),
# bfloat16 on one AVX512-BF16 thread for both (tests/model/test_native_linear_bf16.py)
PACKED = (PackedLinear, NativeLinear, RowSplitLinear)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("rows", [1, 8, 100])
def test_packed_linear_equals_linear(dtype, tol, rows):
    if not packing_supported(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} weights on this CPU")
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 64, generator=gen).to(dtype), torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    with torch.inference_mode():
        for bias in (None, b):
            torch.testing.assert_close(PackedLinear(w, bias)(x), F.linear(x, w, bias),
                                       atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_packs_only_what_onednn_packs_here(tiny_source, dtype):
    """bfloat16 on AVX2 (or with ONEDNN_MAX_CPU_ISA=AVX2): no packing, plain nn.Linear."""
    engine = EngineCore(EngineConfig(model="tiny-random", dtype=dtype, seed=0,
                                     cache=CacheConfig(4, 32)), tiny_source)
    model = engine.runner.model
    assert model.packed == packing_supported(getattr(torch, dtype))
    assert isinstance(model.layers[0].qkv_proj, PACKED if model.packed else torch.nn.Linear)
    add_request(engine, "a", PromptTokens(np.arange(3, 12, dtype=np.int32)),
                SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def test_engine_packs_float_weights_and_greedy_is_unchanged(tiny_source):
    if not packing_supported(torch.float32):
        pytest.skip("oneDNN cannot pack float32 weights here")
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 49152, n).astype(np.int32) for n in (5, 19, 33)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = _greedy(tiny_source, None, prompts, params, pack=False)
    packed = _greedy(tiny_source, None, prompts, params, pack=True)
    assert packed == plain


def _greedy(source, quant, prompts, params, budget=64, pack=True) -> list[list[int]]:
    engine = EngineCore(EngineConfig(model="tiny-random", dtype="float32", quantization=quant,
                                     pack_weights=pack, seed=0, cache=CacheConfig(4, 128),
                                     scheduler=SchedulerConfig(budget, 8)), source)
    model = engine.runner.model
    assert model.quantization == quant
    assert model.packed == (pack and quant is None)
    assert isinstance(model.lm_head, PACKED) == model.packed
    return greedy_tokens(engine, prompts, params)
