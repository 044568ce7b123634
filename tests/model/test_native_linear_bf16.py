"""The bfloat16 C kernel (splitserve/kernels/gemv_bf16.c, AVX512-BF16) against float64, the
row split between it and oneDNN, the fallback where the CPU lacks the instructions, and the
engine's greedy output in bfloat16 with and without the kernel."""

from __future__ import annotations

import ctypes
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.engine.core import EngineCore
from splitserve.kernels import build
from splitserve.model import native_linear
from splitserve.model.native_linear import NativeLinear, TileMemory
from splitserve.model.packed import (NATIVE_BF16_MAX_ROWS, PackedLinear, RowSplitLinear,
                                     packed_linear, packing_supported)
from splitserve.sampling_params import SamplingParams
from engine_requests import greedy_tokens

# SmolLM2-135M's qkv, o, gate_up and down; then tails: fewer rows than one tile, rows not a
# multiple of a tile, odd K (the last pair half zero), K of one.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (7, 5), (33, 17), (100, 3), (5, 1)]

HAS_BF16 = "avx512_bf16" in build._cpu_flags().split()
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="this CPU has no AVX512-BF16 "
                                "(vdpbf16ps): bfloat16 stays on oneDNN here")


def _build(march: str, tmp_path_factory) -> ctypes.CDLL:
    """gemv_bf16.c built for `march` with build.py's flags."""
    cc = build._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    flags = [f for f in build.FLAGS if not f.startswith(("-march=", "-mtune="))]
    out = tmp_path_factory.mktemp("gemv_bf16") / f"gemv_bf16-{march}.so"
    subprocess.run([cc, *flags, f"-march={march}", "-o", str(out),
                    str(build._SOURCES / "gemv_bf16.c")], check=True)
    return native_linear.configure_bf16(ctypes.CDLL(str(out)))


@pytest.mark.parametrize("march", ["haswell", "x86-64", "skylake-avx512"])
def test_builds_without_avx512_bf16_report_the_kernel_unavailable(march, tmp_path_factory):
    """The library builds for every target; without AVX512-BF16 it holds only the answer no
    (a one-instruction function, safe to call on any x86-64)."""
    lib = _build(march, tmp_path_factory)
    assert lib.gemv_bf16_available() == 0
    assert not hasattr(lib, "gemv_bf16_pack")


def _reference_bound(x, w, b):
    """float64 x @ w.T + b of the bfloat16 inputs, and the error allowed: one bfloat16
    rounding of the result plus float32 accumulation over k products."""
    x64, w64 = x.double(), w.double()
    ref = x64 @ w64.T + (0 if b is None else b.double())
    scale = x64.abs() @ w64.abs().T + (0 if b is None else b.double().abs())
    return ref, ref.abs() * 2.0 ** -8 + scale * 1e-5 + 1e-30


@needs_bf16
@pytest.mark.parametrize("n, k", SHAPES)
def test_bf16_kernel_matches_float64_within_bfloat16_rounding(n, k):
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(20, k, generator=gen).bfloat16()
    lib = native_linear._bf16_kernel()
    assert lib is not None
    for bias in (None, b):
        layer = NativeLinear(lib, w, bias)
        for m in range(0, 21):
            y = layer(x[:m])
            assert y.dtype == torch.bfloat16 and y.shape == (m, n)
            ref, bound = _reference_bound(x[:m], w, bias)
            assert ((y.double() - ref).abs() <= bound).all(), (n, k, m)


@needs_bf16
def test_bf16_layers_share_tile_memory_and_keep_leading_dims():
    memory, gen = TileMemory(chunk_bytes=64 << 10), torch.Generator().manual_seed(1)
    weights = [torch.randn(n, k, generator=gen).bfloat16()
               for n, k in [(33, 17), (64, 96), (300, 64), (7, 5), (40, 201)]]
    layers = [NativeLinear(native_linear._bf16_kernel(), w, None, memory) for w in weights]
    for w, layer in zip(weights, layers):
        x = torch.randn(2, 3, w.shape[1], generator=gen).bfloat16()
        y = layer(x)
        assert y.shape == (2, 3, w.shape[0])
        ref, bound = _reference_bound(x.reshape(-1, w.shape[1]), w, None)
        assert ((y.reshape(-1, w.shape[0]).double() - ref).abs() <= bound).all()
        assert layer._tiles.data_ptr() % 64 == 0


@needs_bf16
def test_row_split_runs_the_kernel_for_few_rows_and_onednn_beyond():
    if not packing_supported(torch.bfloat16):
        pytest.skip("oneDNN cannot pack bfloat16 weights here")
    gen = torch.Generator().manual_seed(2)
    w, b = torch.randn(96, 64, generator=gen).bfloat16(), torch.randn(96, generator=gen).bfloat16()
    layer = packed_linear(w, b)
    assert isinstance(layer, RowSplitLinear)
    calls = []
    layer.few.register_forward_hook(lambda *a: calls.append("few"))
    layer.many.register_forward_hook(lambda *a: calls.append("many"))
    for m in (1, NATIVE_BF16_MAX_ROWS, NATIVE_BF16_MAX_ROWS + 1, 40):
        x = torch.randn(m, 64, generator=gen).bfloat16()
        torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1.6e-2, rtol=1.6e-2)
    assert calls == ["few", "few", "many", "many"]


def test_bf16_kernel_chosen_only_with_avx512_bf16(monkeypatch, restore_kernels):
    """Where the CPU (or the kernels' build target) lacks AVX512-BF16, bfloat16 weights go to
    oneDNN's packed layer, as before the kernel; float32 still gets its C kernel."""
    if not packing_supported(torch.bfloat16) or native_linear._kernel() is None:
        pytest.skip("needs oneDNN bfloat16 packing and the gemv kernel")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w = torch.randn(64, 32).bfloat16()
        assert isinstance(packed_linear(w), RowSplitLinear if HAS_BF16 else PackedLinear)
        monkeypatch.setenv("SPLITSERVE_KERNEL_MARCH", "haswell")   # AVX2 code, no vdpbf16ps
        _clear_kernels()
        assert not native_linear.native_linear_supported(torch.bfloat16)
        assert isinstance(packed_linear(w), PackedLinear)
        assert isinstance(packed_linear(w.float()), NativeLinear)
    finally:
        torch.set_num_threads(threads)


def _clear_kernels():
    build.load.cache_clear()
    native_linear._kernel.cache_clear()
    native_linear._bf16_kernel.cache_clear()


@pytest.fixture
def restore_kernels():
    yield
    _clear_kernels()


def _greedy(source, prompts) -> list[list[int]]:
    engine = EngineCore(EngineConfig(model="tiny-random", dtype="bfloat16", num_threads=1, seed=0,
                                     cache=CacheConfig(4, 256), scheduler=SchedulerConfig(64, 8)),
                        source)
    return greedy_tokens(engine, prompts,
                         SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))


@needs_bf16
def test_engine_greedy_in_bf16_unchanged_by_the_kernel(tiny_source, monkeypatch, restore_kernels):
    """bfloat16 decode through the kernel picks the tokens oneDNN's bfloat16 linears pick."""
    if not packing_supported(torch.bfloat16):
        pytest.skip("oneDNN cannot pack bfloat16 weights here")
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 49152, n).astype(np.int32) for n in (4, 23, 70)]
    native = _greedy(tiny_source, prompts)
    monkeypatch.setenv("SPLITSERVE_KERNEL_MARCH", "haswell")
    _clear_kernels()
    assert not native_linear.native_linear_supported(torch.bfloat16)
    assert native == _greedy(tiny_source, prompts)
