"""The device seam (splitserve/platforms/): --device on every entry point, one clear line for a
device this machine lacks, and the device-generic torch attention backend giving the tokens
and logits of the C kernels."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.config import EngineConfig
from splitserve.engine.core import EngineCore
from splitserve.platforms import platform_for, resolve_device

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
NO_GPU = "device cuda: PyTorch sees no CUDA GPU on this machine"


@no_cuda
def test_llm_device_cuda_without_a_gpu_is_a_value_error():
    with pytest.raises(ValueError, match=NO_GPU):
        LLM("tiny-random", device="cuda")


def test_auto_is_the_cpu_where_torch_sees_no_gpu():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") == expected
    assert platform_for("auto").name == expected
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda"):
        EngineConfig(device="gpu")


def test_gpu_memory_utilization_is_refused_on_the_cpu():
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="applies to device cuda only"):
        EngineConfig(device="cpu", gpu_memory_utilization=0.5)
    if not torch.cuda.is_available():   # auto resolves to the CPU in the engine
        with pytest.raises(ValueError, match="applies to device cuda only"):
            EngineCore(EngineConfig(model="tiny-random", gpu_memory_utilization=0.5))


def _generate(monkeypatch, backend: str):
    """Greedy tokens and logprobs (prompt and generated) of prompts sharing a cached prefix,
    prefilled in chunks and decoded as one batch, on the CPU with `backend` attention."""
    monkeypatch.setenv("SPLITSERVE_ATTENTION", backend)
    llm = LLM("tiny-random", device="cpu", dtype="float32", block_size=4, num_blocks=128,
              max_num_batched_tokens=16, max_num_seqs=4, seed=0)
    assert llm.engine.runner.native_attention == (backend == "native")
    shared = list(range(5, 45))                  # 10 full blocks: the later prompts reuse them
    prompts = [shared + [7, 8, 9], shared + [11] * 9, list(range(100, 137))]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    # Prompt logprobs compute every prompt position (no cache reads): the first prompt only.
    first = llm.generate(prompts[:1], msgspec.structs.replace(params, prompt_logprobs=3))
    rest = llm.generate(prompts[1:], params)      # a cached prefix, then a batch of 2
    assert rest[0].num_cached_tokens >= 40
    outs = [c for r in first + rest for c in r.outputs]
    tokens = [c.token_ids for c in outs]
    lps = [lp.logprob for c in outs for lp in c.logprobs]
    lps += [lp.logprob for lp in first[0].prompt_logprobs[1:]]
    return tokens, torch.tensor(lps)


def test_torch_attention_gives_the_c_kernels_tokens_and_logits(monkeypatch):
    native_tokens, native_lps = _generate(monkeypatch, "native")
    torch_tokens, torch_lps = _generate(monkeypatch, "torch")
    assert torch_tokens == native_tokens
    assert (torch_lps - native_lps).abs().max().item() < 1e-4


def test_torch_attention_decode_matches_a_float64_reference():
    """The torch backend's decode (gather + SDPA) over blocks scattered in the cache, with
    and without a sliding window, against attention computed in float64."""
    from splitserve.model.attention import paged_attention
    from test_native_kernels import _decode_case
    for window in (None, 40):
        q, cache, meta, ref = _decode_case(9, 3, 64, [1, 17, 300], 16, window)
        meta = dataclasses.replace(meta, native=False)
        kv = cache[meta.slot_blocks, 1, :, meta.slot_offsets].clone()    # rewritten in place
        out = paged_attention(q, kv, cache, 1, meta, 64 ** -0.5)
        assert (out - ref).abs().max().item() < 1e-5


def test_the_engine_names_its_device(caplog):
    caplog.set_level("INFO", logger="splitserve.engine.core")
    EngineCore(EngineConfig(model="tiny-random", device="cpu", dtype="float32",
                            cache=dataclasses.replace(EngineConfig().cache, num_blocks=16)))
    assert any("float32 on cpu" in r.getMessage() for r in caplog.records)
