#!/usr/bin/env bash
# Fills .gpu_wheels/ (git-ignored, ~10 MB) with what scripts/gpu_check.sh needs on the GPU
# machine and cannot find there: cp312 manylinux wheels of the packages its Python lacks
# (the versions installed here), the bundled model's tokenizer and tiny-random's config
# (the bundled model file itself is too large to travel). Run it here, then send the
# working tree with .gpu_wheels/ to the GPU machine and run scripts/gpu_check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.gpu_wheels}
mkdir -p "$out"
pins=$(python3 - <<'PY'
from importlib.metadata import version
print(" ".join(f"{p}=={version(p)}" for p in
               ("msgspec", "pyzmq", "httptools", "orjson", "pybase64", "gguf", "tqdm")))
PY
)
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$out" $pins
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python3 -m splitserve.bench.gpu.models "$out"
du -sh "$out"
