"""The device seam on the command line: --device cuda on a machine without a GPU is one
usage-error line, and `up` starts no worker."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from server_utils import free_port

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
NO_GPU = "device cuda: PyTorch sees no CUDA GPU on this machine"


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "splitserve.cli", *argv], capture_output=True,
                          text=True, timeout=120)


@no_cuda
@pytest.mark.parametrize("argv", [
    ("serve", "--model", "tiny-random", "--device", "cuda", "--port", "0"),
    ("bench", "engine", "--model", "tiny-random", "--device", "cuda"),
])
def test_device_cuda_without_a_gpu_is_one_usage_error_line(argv):
    done = run(*argv)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"splitserve: error: {argv[0] if argv[0] == 'serve' else 'bench engine'}: {NO_GPU}" \
        in done.stderr
    assert "Traceback" not in done.stderr


@no_cuda
def test_up_with_device_cuda_without_a_gpu_starts_no_worker():
    done = run("up", "--model", "tiny-random", "--device", "cuda", "--port", str(free_port()))
    assert done.returncode == 2 and NO_GPU in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "worker 0" not in done.stderr.split(NO_GPU)[1]
