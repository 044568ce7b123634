"""The offline API on the bundled SmolLM2-135M-Instruct (float32: bf16 can tie top logits)."""

import pytest

from splitserve import LLM, SamplingParams

pytestmark = pytest.mark.bundled

GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", kv_cache_memory_bytes=256 << 20)


def test_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)[0]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"


def test_engine_matches_reference_on_real_model(llm, bundled_source):
    from reference_model import ReferenceModel
    import torch
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. Then the fox")
    ref = ReferenceModel(bundled_source, dtype=torch.float32).greedy(prompt.tolist(), 12)
    out = llm.generate(prompt.tolist(), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == ref


def test_text_prompts_batch_and_stop_string(llm):
    outs = llm.generate(["The capital of Germany is", "1, 2, 3, 4,"],
                        SamplingParams(temperature=0, max_tokens=12, stop=[" 7"]))
    assert "Berlin" in outs[0].outputs[0].text
    counting = outs[1].outputs[0]
    assert counting.text == " 5, 6," and counting.stop_reason == " 7"


def test_chat_knows_simple_facts(llm):
    q = [[{"role": "user", "content": "What is 2 + 2? Answer with one number."}],
         [{"role": "user", "content": "What color is the sky on a clear day?"}]]
    outs = llm.chat(q, GREEDY)
    assert "4" in outs[0].outputs[0].text
    assert "blue" in outs[1].outputs[0].text.lower()


def test_blocks_all_free_after_use(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
