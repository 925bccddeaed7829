#!/usr/bin/env bash
# Everything the test suite and CI need, on top of scripts/setup.sh: the test extra (pytest and its
# plugins, matplotlib, torchdata), the framework integrations (transformers, accelerate, lightning),
# the documentation site's tools, and -- as root with apt -- the Slurm daemons the Slurm tests start.
# Usage: bash scripts/setup_tests.sh   (idempotent)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[test]"
# The framework integrations' tests (tests/test_hf.py, tests/test_lightning.py, marker frameworks):
# the pinned torch is kept (the constraints stop pip from pulling another).
.venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[hf,lightning]"
# The documentation site (mkdocs.yml): mkdocs, mkdocs-material and mkdocstrings (the docs extra).
.venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[docs]"
# Data loading: torchdata's StatefulDataLoader (test extra; ft.batches takes it).
.venv/bin/python -c "import torchdata.stateful_dataloader" \
    || { echo "setup: torchdata (StatefulDataLoader) is missing from .venv" >&2; exit 1; }
# Operating a job: ftrun's metrics (prometheus_client) and report plots (matplotlib, the test extra).
.venv/bin/python -c "import prometheus_client, matplotlib" \
    || { echo "setup: prometheus_client or matplotlib is missing from .venv" >&2; exit 1; }
# The Slurm tests (tests/test_slurm.py) bring up a real cluster: Debian's slurm-wlm and munge, where
# this runs as root with apt (elsewhere those tests skip with one line saying why). Installed
# system-wide: only this script, never scripts/setup.sh, does it.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v slurmctld >/dev/null; then
    { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null; } \
        || echo "setup: apt-get install slurm-wlm munge failed; the Slurm tests will skip" >&2
fi
