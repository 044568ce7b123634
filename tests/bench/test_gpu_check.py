"""The GPU check's parts that need no GPU: the model folders it assembles and its floors."""

import pytest
import torch

from splitserve.bench.gpu import floors, models
from splitserve.model.loader import load_model_source


def test_the_assembled_tiny_random_folder_is_tiny_random(tmp_path):
    models.prepare(str(tmp_path / "prepared"))
    folders = models.assemble(str(tmp_path / "prepared"), str(tmp_path / "work"))
    assert set(folders) == set(models.MODELS)
    named, dummy = load_model_source("tiny-random"), load_model_source(folders["tiny-random"],
                                                                       "dummy")
    assert dummy.config == named.config
    text = "Hello, world"
    assert list(dummy.tokenizer.encode(text)) == list(named.tokenizer.encode(text))
    a, b = dict(named.weights()), dict(dummy.weights())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_llama_3_8b_floors_count_the_published_shapes():
    cfg = load_model_source("llama-3-8b", "dummy").config
    # bfloat16: the layers and lm_head (the input table gives one row a token), 128 KiB of
    # KV a token (32 layers x K and V x 8 heads x 128 x 2 bytes)
    assert floors.decode_bytes(cfg, 2, 1, 0) == 2 * (8_030_261_248 - 128256 * 4096 - 65 * 4096)
    assert floors.decode_bytes(cfg, 2, 8, 1024) - floors.decode_bytes(cfg, 2, 1, 0) \
        == 8 * 1024 * 131072
    assert floors.prefill_flops(cfg, 2048) == pytest.approx(2 * 2048 * 6.98e9, rel=0.05)


def test_floors_measure_something_on_the_cpu():
    assert floors.copy_bandwidth("cpu", 8 << 20, reps=2) > 0
    assert floors.matmul_peak("cpu", 128, "float32", reps=2) > 0
