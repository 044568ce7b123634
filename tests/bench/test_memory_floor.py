"""The bytes a decode step must read (bench/engine/floor.py), counted from the shapes."""

from splitserve.bench.engine import floor
from splitserve.model.loader import load_model_source


def test_a_step_reads_each_linear_once_and_each_sequence_its_kv():
    cfg = load_model_source("tiny-random").config
    n = floor.linear_elements(cfg)
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    assert n == cfg.num_layers * (h * (2 * q + 2 * kv) + 3 * h * i) + cfg.vocab_size * h
    assert floor.weight_bytes(cfg, "bfloat16") == 2 * n
    assert floor.weight_bytes(cfg, "float32") == 4 * n
    assert n < floor.weight_bytes(cfg, "int8") < 1.1 * n       # one byte plus the scales
    one, eight = (floor.step_bytes(cfg, "float32", 4, b, 100) for b in (1, 8))
    per_sequence = 100 * cfg.kv_bytes_per_token(4) + 4 * h
    assert eight - one == 7 * per_sequence


def test_read_bandwidth_is_a_positive_rate():
    assert floor.read_bandwidth(passes=1) > 1e8
