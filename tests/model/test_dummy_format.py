"""--load-format dummy: a model from a config.json alone, with seeded random weights."""

import json

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.errors import ModelLoadError
from splitserve.model.dummy import CONFIGS_DIR
from splitserve.model.loader import load_model_source

TINY = f"{CONFIGS_DIR}/tiny-llama.json"


def _folder(tmp_path, **changes):
    with open(TINY) as f:
        config = {**json.load(f), **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_builds_the_configs_shapes_without_reading_a_checkpoint(tmp_path):
    source = load_model_source(_folder(tmp_path), "dummy")
    cfg = source.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (2, 8, 2)   # GQA
    weights = dict(source.weights())
    assert weights["model.layers.1.self_attn.k_proj.weight"].shape == (cfg.kv_size, cfg.hidden_size)
    assert weights["lm_head.weight"].shape == (cfg.vocab_size, cfg.hidden_size)   # untied
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_weights_are_the_same_on_every_call_and_differ_by_tensor(tmp_path):
    source = load_model_source(_folder(tmp_path), "dummy")
    a, b = dict(source.weights()), dict(source.weights())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"],
                           a["model.layers.1.mlp.up_proj.weight"])


def test_a_shipped_config_by_name_and_a_json_path_are_the_same_model():
    by_name, by_path = load_model_source("tiny-llama", "dummy"), load_model_source(TINY, "dummy")
    assert by_name.config == by_path.config
    assert by_name.config.name == "tiny-llama"


def test_llama_3_8b_config_has_the_published_shapes():
    cfg = load_model_source("llama-3-8b", "dummy").config
    params = (2 * cfg.vocab_size * cfg.hidden_size + cfg.num_layers * (
        cfg.hidden_size * (2 * cfg.q_size + 2 * cfg.kv_size) + 3 * cfg.hidden_size
        * cfg.intermediate_size + 2 * cfg.hidden_size) + cfg.hidden_size)
    assert params == 8_030_261_248     # Meta-Llama-3-8B's parameter count


def test_without_tokenizer_the_bundled_one_serves_with_its_own_eos(tmp_path):
    source = load_model_source(_folder(tmp_path, eos_token_id=128001), "dummy")
    assert source.config.eos_token_ids == source.tokenizer.eos_token_ids
    assert 128001 not in source.config.eos_token_ids


def test_a_folders_tokenizer_is_used_when_present(tmp_path):
    bundled = load_model_source("tiny-llama", "dummy").tokenizer
    bundled.save_hf(str(tmp_path))
    source = load_model_source(_folder(tmp_path, bos_token_id=7, eos_token_id=9), "dummy")
    assert source.config.eos_token_ids == (9,) and source.tokenizer.eos_token_ids == (9,)


def test_llm_serves_a_completion(tmp_path):
    llm = LLM(_folder(tmp_path), load_format="dummy", dtype="float32", num_blocks=64,
              num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first, again = (llm.generate("The capital of France is", params)[0] for _ in range(2))
    assert len(first.outputs[0].token_ids) == 6
    assert first.outputs[0].token_ids == again.outputs[0].token_ids


def test_folder_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="holds no config.json"):
        load_model_source(str(tmp_path), "dummy")


def test_non_llama_architecture_is_a_clear_error(tmp_path):
    folder = _folder(tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*not supported"):
        load_model_source(folder, "dummy")


def test_unknown_name_and_no_model_name_what_dummy_takes():
    with pytest.raises(ModelLoadError, match="llama-3-8b"):
        load_model_source("no-such-config", "dummy")
    with pytest.raises(ModelLoadError, match="needs --model"):
        load_model_source(None, "dummy")


def test_auto_format_still_needs_weights(tmp_path):
    with pytest.raises(ModelLoadError):
        load_model_source(_folder(tmp_path))
