#!/usr/bin/env bash
# Create .venv and install ftrun with its test and example dependencies.
# Usage: bash scripts/setup.sh   (idempotent; re-running it only checks what is there)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned, so that nothing later resolves "torch" to a CUDA build.
.venv/bin/python -m pip install -q -c scripts/constraints.txt torch numpy
.venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[test]"
# Data loading: torchdata's StatefulDataLoader (test extra; ft.batches takes it).
.venv/bin/python -c "import torchdata.stateful_dataloader" \
    || { echo "setup: torchdata (StatefulDataLoader) is missing from .venv" >&2; exit 1; }
# Operating a job: ftrun's metrics (prometheus_client) and report plots (matplotlib, the test extra).
.venv/bin/python -c "import prometheus_client, matplotlib" \
    || { echo "setup: prometheus_client or matplotlib is missing from .venv" >&2; exit 1; }
