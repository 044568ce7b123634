"""The worker front-end and the orchestrator load no torch: only an engine process does.
torch costs a process about a second of start-up and a few hundred MB it never uses."""

from __future__ import annotations

import subprocess
import sys


def test_worker_front_end_imports_no_torch():
    # The front-end loads the model's config and tokenizer, never its weights.
    code = ("import sys; from splitserve.model.loader import load_model_source; "
            "import splitserve.server.app; source = load_model_source('tiny-random'); "
            "from splitserve import cli; cli.server_config(cli.build_parser().parse_args("
            "['serve', '--model', 'tiny-random']), 1); "
            "assert source.tokenizer.encode('hi') and source.config.num_layers; "
            "assert 'torch' not in sys.modules, 'torch'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_an_engine_builds_and_runs_without_torch_dynamo_or_sympy():
    """Computing on the meta device (a module's init, RoPE tables, empty_like) runs torch's
    Python decompositions, whose imports of torch._dynamo and sympy took ~2.6 s of every
    engine's start."""
    code = ("import sys; from splitserve import LLM, SamplingParams; "
            "llm = LLM('tiny-random', dtype='float32', num_threads=1); "
            "llm.generate(['hi'], SamplingParams(max_tokens=2, prompt_logprobs=1, n=2)); "
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo'; "
            "assert 'sympy' not in sys.modules, 'sympy'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
