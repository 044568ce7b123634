"""The kernels' helper thread (splitserve/kernels/pool.c, model/native_pool.py): shared
kernels compute what they compute alone, and a helper that loses its CPU mid-range costs
the engine thread nothing but that range."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.kernels import build

pytestmark = pytest.mark.skipif(build.load("pool") is None or build.load("gemv") is None,
                                reason="no C compiler on this machine")


def _probe() -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    here = Path(__file__).parent                 # test_native_kernels.py: the cases
    support = here.parent / "support"            # pool_probe.py
    path = os.pathsep.join([str(here), str(support), os.environ.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(support / "pool_probe.py"), str(cpus[0]), str(cpus[-1])],
                         capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=path))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def probe() -> dict:
    return _probe()


def test_shared_kernels_match_float64(probe):
    assert probe["started"]
    assert probe["linear_same"] and probe["attention_same"] and probe["decode_same"]
    assert probe["decode_err"] < 1e-5
    assert probe["linear_err"] < 1e-3          # sums of 1,536 products of N(0, 1) values
    assert probe["attention_err"] < 4e-6       # what test_native_kernels holds alone
    if len(os.sched_getaffinity(0)) > 1:
        assert probe["helped"] > 0             # on a CPU of its own, the helper took work


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                    reason="the helper needs a CPU the engine thread does not keep busy")
def test_a_stalled_helper_range_is_taken_back(probe):
    """The helper sleeps 2 s after claiming a range, as if the front-end (or another
    process) held its CPU: the engine thread takes the range back and returns at once, and
    the stale range the helper finishes later reaches no output, nor reads outside the KV
    cache though later jobs overwrote the staging copies it reads (the probe process would
    die of SIGSEGV)."""
    assert probe["taken_back"] >= 1 and probe["attention_taken_back"] >= 1
    assert probe["decode_taken_back"] >= 1
    assert 0 < probe["slowest_call_s"] < 0.5
    assert probe["linear_same_after"] and probe["attention_same_after"]
    assert probe["decode_same_after"] and probe["decode_err_after"] < 1e-5
    assert probe["linear_err_after"] < 1e-3
    assert probe["attention_err_after"] < 4e-6


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                    reason="the helper needs a CPU the engine thread does not keep busy")
def test_memory_a_stale_range_reads_is_freed_only_after_it(probe):
    """A helper stalled 1 s in a range the engine thread took back still reads the weights
    (or the KV cache) when it wakes. native_pool.quiesce() waits for it, and a ModelRunner
    calls it before its model and cache are freed; otherwise the probe reads unmapped tiles
    and dies of SIGSEGV, as `bench engine` did at exit on a busy machine."""
    assert probe["quiesce_waited_s"] > 0.5
    assert probe["runner_freed_after_s"] > 0.5


def test_the_helper_cpu_setting_names_what_is_wrong(monkeypatch):
    from splitserve import envs
    for value, cpu in (("", None), ("none", None), (" NONE ", None), ("3", 3)):
        monkeypatch.setenv("SPLITSERVE_ENGINE_HELPER_CPU", value)
        assert envs.engine_helper_cpu() == cpu
    for bad in ("x", "-1", "0,1"):
        monkeypatch.setenv("SPLITSERVE_ENGINE_HELPER_CPU", bad)
        with pytest.raises(ValueError, match="SPLITSERVE_ENGINE_HELPER_CPU must be a CPU"):
            envs.engine_helper_cpu()
