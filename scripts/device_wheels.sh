#!/usr/bin/env bash
# Download into device_wheels/ the wheels a lent GPU machine lacks, so that they travel with the
# working tree (the device tool's `carry`: 64 MiB in all, wheels and tree together).
#
# The lent machine (docs/gpu.md) has Python 3.12 with torch, numpy, msgpack, xxhash, typer, rich,
# psutil, prometheus-client, pytest, pytest-xdist and pytest-timeout, and no package registry. Of
# ftrun's runtime imports only pyzmq is missing there; pytest-rerunfailures is the tests' one missing
# plugin (tests/conftest.py gives integration tests one rerun with it, and runs without it).
#
# Usage (here, where pip reaches a registry):  bash scripts/device_wheels.sh [EXTRA_REQUIREMENT ...]
# Then, on the lent machine:  python3 -m pip install -q --no-index --find-links device_wheels pyzmq ...
# (scripts/gpu_check.sh does that). Prints the folder's size at the end; about 1 MiB with the default list.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
DEST=device_wheels
# Versions pinned to what this project tests with here (.venv), so both machines run the same code.
WHEELS=("pyzmq==27.3.0" "pytest-rerunfailures==16.7" "$@")
mkdir -p "$DEST"
# Binary wheels only, for CPython 3.12 on x86-64 Linux. pip matches a manylinux_2_N tag exactly, so
# the common ones are named; --no-deps because the lent machine has every dependency of these
# (packaging and pytest for pytest-rerunfailures; pyzmq needs none on CPython).
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform any \
    -d "$DEST" "${WHEELS[@]}"
ls -1 "$DEST"
echo "device_wheels: $(du -sh "$DEST" | cut -f1) in $(ls -1 "$DEST" | wc -l) wheel(s) (the carry limit is 64 MiB with the tree)"
