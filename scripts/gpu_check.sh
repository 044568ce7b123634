#!/usr/bin/env bash
# The GPU check (docs/benchmarks.md, "GPU"): on a machine with one NVIDIA H100/H200, in
# under 8 minutes, prints greedy equality with transformers, `bench engine` on Llama-3-8B
# shapes against the card's measured floors, and `splitserve up` on the one card.
#   scripts/gpu_wheels.sh                  # here: fills .gpu_wheels/
#   scripts/gpu_check.sh                   # there: installs what is missing from it, runs
#   scripts/gpu_check.sh --cpu-dry-run     # every step, small, on the CPU (installs nothing)
# More options: python3 -m splitserve.bench.gpu.check --help (e.g. --skip bench).
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=${GPU_WHEELS:-.gpu_wheels}
if [ ! -d "$wheels/tokenizer" ]; then
    echo "gpu check: $wheels is not prepared; run scripts/gpu_wheels.sh first" >&2
    exit 2
fi
if [[ " $* " != *" --cpu-dry-run "* ]]; then
    missing=$(python3 - <<'PY'
import importlib.util
modules = {"msgspec": "msgspec", "zmq": "pyzmq", "httptools": "httptools", "orjson": "orjson",
           "pybase64": "pybase64", "gguf": "gguf", "tqdm": "tqdm"}
print(" ".join(p for m, p in modules.items() if importlib.util.find_spec(m) is None))
PY
)
    if [ -n "$missing" ]; then
        echo "gpu check: installing from $wheels: $missing"
        # shellcheck disable=SC2086
        python3 -m pip install -q --no-deps --no-index --find-links "$wheels" $missing
    fi
    python3 -m pip install -q --no-deps --no-index --no-build-isolation -e . \
        || echo "gpu check: the project runs from PYTHONPATH (its editable install failed)"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec timeout 470 python3 -m splitserve.bench.gpu.check "$wheels" "$@"
