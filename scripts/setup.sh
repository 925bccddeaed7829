#!/usr/bin/env bash
# Create .venv with what running a job needs: the pinned CPU build of torch, ftrun, and the
# examples' dependencies (scikit-learn's digits, torchdata's StatefulDataLoader).
# Usage: bash scripts/setup.sh   (idempotent; re-running it only checks what is there)
# The tests need more (bash scripts/setup_tests.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned, so that nothing later resolves "torch" to a CUDA build.
.venv/bin/python -m pip install -q -c scripts/constraints.txt torch numpy
.venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[examples]"
