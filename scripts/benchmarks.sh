#!/usr/bin/env bash
# Regenerates docs/benchmarks.md and docs/img/ from real runs: engine, one worker,
# aggregated vs disaggregated, and the GEN front-end's token relay. ~15 min on 2 cores.
#   bash scripts/benchmarks.sh            # the full report
#   bash scripts/benchmarks.sh --quick    # ~2 min smoke test, written under bench-results/quick/
#   bash scripts/benchmarks.sh --vllm-venv VENV   # adds a section against CPU vLLM (VENV)
# Any other argument goes to `splitserve bench report` (see its --help).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m splitserve.cli bench report "$@"
