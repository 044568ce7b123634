"""The plain PyTorch reference `bench engine --plain-reference` times."""

import math

import torch

from splitserve.bench.engine import plain_reference
from splitserve.bench.engine.main import add_arguments, run
from splitserve.model.loader import load_model_source


def test_a_plain_forward_of_the_model_shapes_is_timed():
    cfg = load_model_source("tiny-random").config
    tps = plain_reference.prefill_tok_s(cfg, torch.float32, 32, 3)
    assert math.isfinite(tps) and tps > 0


def test_bench_engine_records_the_reference_next_to_its_prefill(tmp_path):
    import argparse
    import json
    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp_path / "engine.json"
    run(p.parse_args(["--model", "tiny-random", "--dtype", "float32", "--prefill-len", "16",
                      "--repeats", "1", "--batch-sizes", "1", "--decode-steps", "2",
                      "--plain-reference", "--json", str(out)]))
    result = json.loads(out.read_text())
    assert result["plain_reference_prefill_tok_s"] > 0 and result["prefill_tok_s"] > 0
    assert "plain_reference" in result["other_cores_busy"]
