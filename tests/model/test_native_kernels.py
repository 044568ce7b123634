"""The C kernels (splitserve/kernels/) against PyTorch, and how they are built and refused."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from splitserve.kernels import build
from splitserve.model import native_attention

pytestmark = pytest.mark.skipif(build.load("attention") is None,
                                reason="no C compiler on this machine")


def _avx2() -> bool:
    with open("/proc/cpuinfo") as f:
        return " avx2 " in f.read()


def _paged_case(heads, kv_heads, dim, total, start, block_size, window, seed=0, layers=3):
    """A shuffled paged cache holding keys/values for positions 0..total-1 at layer 1, the
    queries of positions start..total-1 as a strided view like the engine's, and the float64
    reference output."""
    g = torch.Generator().manual_seed(seed)
    n = (total + block_size - 1) // block_size
    cache = torch.randn(n + 3, layers, 2, block_size, kv_heads, dim, generator=g)
    table = torch.randperm(n + 3, generator=g)[:n].view(1, -1)
    qkv = torch.randn(total - start, heads + 2 * kv_heads, dim, generator=g)
    q = qkv[:, :heads]                                              # (L, H, D), rows strided
    keys, vals = (cache[table[0], 1, i].reshape(-1, kv_heads, dim)[:total].transpose(0, 1)
                  for i in (0, 1))                                   # (KVH, S, D)
    pos, key = torch.arange(start, total).view(-1, 1), torch.arange(total).view(1, -1)
    allowed = key <= pos
    if window:
        allowed &= key > pos - window
    ref = F.scaled_dot_product_attention(q.transpose(0, 1).double(), keys.double(), vals.double(),
                                         attn_mask=allowed, scale=dim ** -0.5, enable_gqa=True)
    return q, cache, table, ref.transpose(0, 1).float()


CASES = [  # heads, kv_heads, dim, total, start, block_size, window
    (9, 3, 64, 700, 0, 16, None),        # SmolLM2's heads, a first chunk
    (9, 3, 64, 700, 512, 16, None),      # a later chunk over earlier context
    (9, 3, 64, 37, 36, 16, None),        # one query
    (4, 4, 32, 77, 5, 8, None),          # no grouping, a position tail in every vector
    (14, 2, 64, 129, 0, 16, None),       # 7 heads per KV head: units of 3, 3 and 1
    (8, 2, 128, 90, 1, 4, None),         # head_dim 128
    (9, 3, 64, 500, 100, 16, 64),        # sliding window
    (6, 3, 64, 300, 0, 16, 40),          # window from the first position
]


@pytest.mark.parametrize("case", CASES)
def test_prefill_attention_matches_sdpa(case):
    heads, kv_heads, dim, total, start, block_size, window = case
    q, cache, table, ref = _paged_case(*case)
    out = native_attention.prefill(q, cache, 1, table, start, window, dim ** -0.5)
    sdpa_err = 2e-6    # what float32 SDPA reaches against float64 on these cases
    assert out is not None and (out - ref).abs().max().item() < 2 * sdpa_err


@pytest.mark.skipif(not _avx2(), reason="the CPU has no AVX2")
def test_avx2_build_matches_the_native_build(monkeypatch):
    """The AVX2 code path (8-float vectors) computes every row as the native one does."""
    lib = build.build_for("attention", "haswell")
    assert lib is not None
    monkeypatch.setattr(native_attention, "_kernel", lambda: native_attention.bind(lib))
    for case in CASES:
        q, cache, table, ref = _paged_case(*case)
        out = native_attention.prefill(q, cache, 1, table, case[4], case[6], case[2] ** -0.5)
        assert (out - ref).abs().max().item() < 4e-6
    lib = build.build_for("attention_decode", "haswell")
    monkeypatch.setattr(native_attention, "_decode_kernel", lambda: native_attention.bind_decode(lib))
    for case in DECODE_CASES:
        q, cache, meta, ref = _decode_case(*case)
        out = native_attention.decode(q, cache, 1, meta.decode_block_table, meta.decode_positions,
                                      case[5], case[2] ** -0.5)
        assert (out - ref).abs().max().item() < 4e-6


def _decode_case(heads, kv_heads, dim, contexts, block_size, window, seed=0, layers=3):
    """Decode queries for sequences of the given context lengths (query at the last
    position), their blocks scattered over a shared paged cache, and the float64 reference."""
    from splitserve.model.attention import build_metadata
    g = torch.Generator().manual_seed(seed)
    per = [(n + block_size - 1) // block_size for n in contexts]
    cache = torch.randn(sum(per) + 2, layers, 2, block_size, kv_heads, dim, generator=g)
    perm = torch.randperm(sum(per) + 2, generator=g).numpy()
    tables = [perm[sum(per[:i]):sum(per[:i + 1])] for i in range(len(contexts))]
    meta = build_metadata(block_size, [(t, n - 1) for t, n in zip(tables, contexts)], [], window)
    q = torch.randn(len(contexts), heads + 2 * kv_heads, dim, generator=g)[:, :heads]
    refs = []
    for i, (t, n) in enumerate(zip(tables, contexts)):
        k, v = (cache[torch.from_numpy(t), 1, j].reshape(-1, kv_heads, dim)[:n].transpose(0, 1)
                for j in (0, 1))
        allowed = torch.ones(1, n, dtype=torch.bool)
        if window:
            allowed[0, :max(0, n - window)] = False
        refs.append(F.scaled_dot_product_attention(
            q[i].unsqueeze(1).double(), k.double(), v.double(), attn_mask=allowed,
            scale=dim ** -0.5, enable_gqa=True).squeeze(1).float())
    return q, cache, meta, torch.stack(refs)


DECODE_CASES = [  # heads, kv_heads, dim, contexts, block_size, window
    (9, 3, 64, [1, 17, 300, 2000], 16, None),   # SmolLM2's heads; a context of one key
    (4, 4, 64, [5, 64, 65], 8, None),           # no grouping
    (14, 2, 64, [100, 33], 16, None),           # 7 heads per KV head: the generic tile
    (8, 2, 128, [40, 129], 4, None),            # head_dim 128
    (9, 3, 64, [500, 30, 64], 16, 64),          # sliding window, shorter and longer
]


@pytest.mark.parametrize("case", DECODE_CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_matches_sdpa(case, threads):
    q, cache, meta, ref = _decode_case(*case)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = native_attention.decode(q, cache, 1, meta.decode_block_table, meta.decode_positions,
                                      case[5], case[2] ** -0.5)
    finally:
        torch.set_num_threads(before)
    assert out is not None and (out - ref).abs().max().item() < 4e-6


BITWISE_CASES = [  # heads, kv_heads, dim, total, block_size, window
    (9, 3, 64, 300, 16, None),     # SmolLM2's heads; queries on both sides of a tile's edge
    (4, 2, 16, 150, 4, None),      # tiny-random's
    (14, 2, 64, 130, 16, None),    # 7 heads per KV head: the generic tile
    (8, 2, 128, 90, 4, None),      # head_dim 128
    (9, 3, 64, 300, 16, 100),      # sliding window
]


@pytest.mark.parametrize("case", BITWISE_CASES)
def test_a_query_attends_to_the_same_bits_in_any_chunk_and_in_a_decode_step(case):
    """A position's output is one function of its query and keys: in a whole prefill, in a
    chunk starting anywhere before it, and as a decode step (a migrated stream prefilled
    again, a prompt's last token recomputed alone, must not move a seeded draw)."""
    heads, kv_heads, dim, total, block_size, window = case
    q, cache, table, _ = _paged_case(heads, kv_heads, dim, total, 0, block_size, window)
    scale = dim ** -0.5
    whole = native_attention.prefill(q, cache, 1, table, 0, window, scale)
    for start, end in [(1, 9), (63, 66), (64, 65), (total - 70, total - 1), (total - 1, total)]:
        chunk = native_attention.prefill(q[start:end], cache, 1, table, start, window, scale)
        assert torch.equal(chunk, whole[start:end]), (start, end)
    positions = torch.tensor([0, 1, 62, 63, 64, 65, total // 2, total - 1])
    tables = table.expand(len(positions), -1).contiguous()
    decoded = native_attention.decode(q[positions], cache, 1, tables, positions, window, scale)
    assert decoded is not None
    for row, p in zip(decoded, positions.tolist()):
        assert torch.equal(row, whole[p]), (p, float((row - whole[p]).abs().max()))


def test_unsupported_head_dim_falls_back():
    q, cache, table, _ = _paged_case(2, 1, 260, 20, 0, 4, None)
    assert native_attention.prefill(q, cache, 1, table, 0, None, 0.1) is None
    q, cache, meta, _ = _decode_case(2, 1, 260, [20], 4, None)
    assert native_attention.decode(q, cache, 1, meta.decode_block_table, meta.decode_positions,
                                   None, 0.1) is None


def test_engine_output_is_unchanged_without_the_kernel(tiny_source, monkeypatch):
    """Greedy tokens and the logits they come from, with chunked prefill over earlier
    context, are the same through SDPA as through the kernel."""
    from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.engine.core import EngineCore
    from splitserve.model.attention import build_metadata

    def logits(native: bool):
        monkeypatch.setattr(native_attention, "usable", lambda q: native)
        monkeypatch.setattr(native_attention, "decode_usable", lambda q: native)
        cfg = EngineConfig(model="tiny-random", dtype="float32", seed=0,
                           cache=CacheConfig(4, 64, enable_prefix_caching=False),
                           scheduler=SchedulerConfig(16, 4))
        runner = EngineCore(cfg, tiny_source).runner
        model, kv = runner.model, runner.kv_cache
        ids = torch.randint(3, 1000, (40,), generator=torch.Generator().manual_seed(1))
        blocks = torch.arange(11).numpy()
        out = []
        for s in range(0, 40, 16):     # three chunks, the later two over earlier context
            n = min(16, 40 - s)
            meta = build_metadata(4, [], [(blocks, s, n)], None)
            out.append(model.logits(model(ids[s:s + n], torch.arange(s, s + n), kv, meta)))
        for s in range(40, 44):        # then decodes, one token each
            meta = build_metadata(4, [(blocks, s)], [], None)
            out.append(model.logits(model(ids[s - 40:s - 39], torch.tensor([s]), kv, meta)))
        return torch.cat(out)

    with_kernel, without = logits(True), logits(False)
    assert torch.equal(with_kernel.argmax(-1), without.argmax(-1))
    assert (with_kernel - without).abs().max().item() < 1e-4


def test_a_failed_build_gives_none_and_says_why(tmp_path, monkeypatch, caplog):
    (tmp_path / "broken.c").write_text("int f( {\n")
    monkeypatch.setattr(build, "_SOURCES", tmp_path)
    monkeypatch.setenv("SPLITSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING):
        assert build.build_for("broken", "native") is None
    assert "building the broken kernel failed" in caplog.text and "error" in caplog.text
    assert not list((tmp_path / "cache").glob("*.so"))     # nothing half-written is kept


def test_a_damaged_cached_build_is_built_again(tmp_path, monkeypatch, caplog):
    (tmp_path / "answer.c").write_text("int answer(void) { return 42; }\n")
    monkeypatch.setattr(build, "_SOURCES", tmp_path)
    monkeypatch.setenv("SPLITSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    path, cached = build._build(build._compiler(), "answer", "native")    # built, not loaded
    assert not cached
    path.write_bytes(b"\x7fELF truncated")
    with caplog.at_level(logging.WARNING):
        lib = build.build_for("answer", "native")
    assert lib is not None and lib.answer() == 42
    assert "the cached answer kernel does not load" in caplog.text
    assert build._build(build._compiler(), "answer", "native") == (path, True)


def test_no_compiler_or_switched_off_gives_none(monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING):
        assert build.build_for("attention", "native") is None
    assert "building the attention kernel failed" in caplog.text
    monkeypatch.delenv("CC")
    monkeypatch.setenv("SPLITSERVE_NATIVE_KERNELS", "0")
    assert build.build_for("attention", "native") is None


def test_builds_are_cached_by_source(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_KERNEL_CACHE", str(tmp_path))
    assert build.build_for("attention", "native") is not None
    first = list(tmp_path.glob("attention-*.so"))
    assert build.build_for("attention", "native") is not None
    assert list(tmp_path.glob("attention-*.so")) == first and len(first) == 1


@pytest.mark.parametrize("threads", [2, 3])
def test_several_threads_split_the_rows_and_agree(threads):
    """With several torch threads the chunk's rows run as ranges on a pool: same result."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for case in [(9, 3, 64, 700, 512, 16, None), (9, 3, 64, 300, 0, 16, 64),
                     (4, 4, 32, 40, 5, 8, None)]:
            q, cache, table, ref = _paged_case(*case)
            out = native_attention.prefill(q, cache, 1, table, case[4], case[6], case[2] ** -0.5)
            assert (out - ref).abs().max().item() < 4e-6
    finally:
        torch.set_num_threads(before)


def test_split_rows_cover_the_chunk_with_balanced_work():
    from splitserve.model.native_attention import _split
    for length, start, parts in [(512, 0, 2), (512, 1536, 2), (2000, 0, 7), (40, 0, 4), (17, 0, 2)]:
        ranges = _split(length, start, parts)
        assert ranges[0][0] == 0 and ranges[-1][1] == length
        assert all(a < b and b == c for (a, b), (c, _) in zip(ranges, ranges[1:]))
        work = [sum(start + i + 1 for i in range(a, b)) for a, b in ranges]
        if length >= 512:
            assert len(ranges) == parts and max(work) < 1.25 * sum(work) / parts


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("width", [576, 37])
def test_fused_elementwise_steps_match_pytorch(rows, width):
    from splitserve.model import fused
    from splitserve.model.llama import RMSNorm
    g = torch.Generator().manual_seed(rows * width)
    norm = RMSNorm(width, 1e-5)
    norm.weight.data = torch.randn(width, generator=g)
    x, delta = torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)
    expected_x = x + delta
    expected = F.rms_norm(expected_x, (width,), norm.weight, 1e-5)
    got_x = x.clone()
    torch.testing.assert_close(fused.add_rms_norm(got_x, delta, norm), expected,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_x, expected_x)                      # updated in place
    torch.testing.assert_close(fused.add_rms_norm(got_x.clone(), None, norm), expected,
                               atol=1e-5, rtol=1e-5)
    gate_up = torch.randn(rows, 2 * width, generator=g) * 30            # silu's tails too
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_mul(gate_up), F.silu(gate) * up, atol=1e-4, rtol=1e-5)
