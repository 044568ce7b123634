"""The C tile kernel's linear (splitserve/model/native_linear.py) against F.linear, for each
vector width the kernel is written for, and the engine's greedy output with and without it."""

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
from splitserve.model.packed import PackedLinear, RowSplitLinear, packed_linear, packing_supported
from splitserve.sampling_params import SamplingParams
from engine_requests import greedy_tokens

# SmolLM2-135M's qkv, o, gate_up and down; then tails: fewer rows than one tile, rows not a
# multiple of a tile, odd K.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (7, 5), (33, 17), (100, 3), (1, 64)]


def _cpu_has(*flags: str) -> bool:
    have = build._cpu_flags().split()
    return all(f in have for f in flags)


def _kernel_for(march: str, tmp_path_factory) -> ctypes.CDLL:
    """gemv.c built for `march` with build.py's flags: AVX-512 here may hide an AVX2 bug."""
    cc = build._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    flags = [f for f in build.FLAGS if not f.startswith(("-march=", "-mtune="))]
    out = tmp_path_factory.mktemp("gemv") / f"gemv-{march}.so"
    subprocess.run([cc, *flags, f"-march={march}", "-o", str(out),
                    str(build._SOURCES / "gemv.c")], check=True)
    return native_linear.configure(ctypes.CDLL(str(out)))


MARCHES = ["native",
           pytest.param("haswell", marks=pytest.mark.skipif(not _cpu_has("avx2", "fma"),
                                                            reason="no AVX2 here")),
           "x86-64"]   # no AVX: the kernel's portable 4-wide fallback


@pytest.fixture(scope="module", params=MARCHES)
def kernel(request, tmp_path_factory):
    return _kernel_for(request.param, tmp_path_factory)


@pytest.mark.parametrize("n, k", SHAPES)
def test_native_linear_equals_linear(kernel, n, k):
    gen = torch.Generator().manual_seed(n * k)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(20, k, generator=gen)
    for bias in (None, b):
        layer = NativeLinear(kernel, w, bias)
        for m in range(0, 21):
            torch.testing.assert_close(layer(x[:m]), F.linear(x[:m], w, bias),
                                       atol=1e-4, rtol=1e-4)


def test_native_linear_many_rows_and_leading_dims(kernel):
    """Prefill's hundreds of rows take the same path; (B, T, K) inputs keep their shape."""
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(200, 96, generator=gen), torch.randn(200, generator=gen)
    x = torch.randn(3, 171, 96, generator=gen)
    torch.testing.assert_close(NativeLinear(kernel, w, b)(x), F.linear(x, w, b),
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(NativeLinear(kernel, w, b)(x[:, 5]), F.linear(x[:, 5], w, b),
                               atol=1e-4, rtol=1e-4)   # a strided input


def test_layers_sharing_tile_memory_keep_their_own_weights(kernel):
    """Tiles carved one after another from shared chunks (here 64 KB, so some layers start a
    chunk and one is bigger than a chunk) must not overlap."""
    memory, gen = TileMemory(chunk_bytes=64 << 10), torch.Generator().manual_seed(1)
    weights = [torch.randn(n, k, generator=gen) for n, k in [(33, 17), (64, 96), (300, 64),
                                                             (7, 5), (96, 64), (40, 200)]]
    layers = [NativeLinear(kernel, w, None, memory) for w in weights]
    for w, layer in zip(weights, layers):
        x = torch.randn(3, w.shape[1], generator=gen)
        torch.testing.assert_close(layer(x), F.linear(x, w), atol=1e-4, rtol=1e-4)
        assert layer._tiles.data_ptr() % 64 == 0


def test_packed_linear_chooses_native_only_on_one_thread(monkeypatch):
    if native_linear._kernel() is None:
        pytest.skip("the gemv kernel cannot be built here")
    w = torch.randn(64, 32)
    assert isinstance(packed_linear(w), NativeLinear)
    if packing_supported(torch.bfloat16):
        bf16 = native_linear.native_linear_supported(torch.bfloat16)   # AVX512-BF16 only
        assert isinstance(packed_linear(w.bfloat16()), RowSplitLinear if bf16 else PackedLinear)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert isinstance(packed_linear(w), PackedLinear)
    finally:
        torch.set_num_threads(threads)


def _native_off(monkeypatch):
    """As with SPLITSERVE_NATIVE_KERNELS=0: build.load gives None, oneDNN's path runs."""
    monkeypatch.setenv("SPLITSERVE_NATIVE_KERNELS", "0")
    build.load.cache_clear()
    native_linear._kernel.cache_clear()


@pytest.fixture
def restore_kernels():
    yield
    build.load.cache_clear()
    native_linear._kernel.cache_clear()


def _greedy(source, model: str, prompts, native: bool) -> list[list[int]]:
    engine = EngineCore(EngineConfig(model=model, dtype="float32", num_threads=1, seed=0,
                                     cache=CacheConfig(4, 256), scheduler=SchedulerConfig(64, 8)),
                        source)
    lm_head = engine.runner.model.lm_head
    assert isinstance(lm_head, NativeLinear if native else PackedLinear)
    return greedy_tokens(engine, prompts,
                         SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))


def _greedy_native_and_off(source, model, monkeypatch):
    if not packing_supported(torch.float32) or native_linear._kernel() is None:
        pytest.skip("needs both oneDNN packing and the gemv kernel")
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 49152, n).astype(np.int32) for n in (4, 23, 70)]
    native = _greedy(source, model, prompts, native=True)
    _native_off(monkeypatch)
    return native, _greedy(source, model, prompts, native=False)


def test_engine_greedy_unchanged_by_native_kernel_tiny(tiny_source, monkeypatch, restore_kernels):
    native, onednn = _greedy_native_and_off(tiny_source, "tiny-random", monkeypatch)
    assert native == onednn


@pytest.mark.bundled
def test_engine_greedy_unchanged_by_native_kernel_bundled(bundled_source, monkeypatch,
                                                          restore_kernels):
    native, onednn = _greedy_native_and_off(bundled_source, None, monkeypatch)
    assert native == onednn
