#!/usr/bin/env bash
# Create .venv with ringserve installed in editable mode. Idempotent; safe to re-run.
#   scripts/setup.sh            runtime dependencies only
#   scripts/setup.sh test       + test dependencies (what CI uses)
#   scripts/setup.sh test,gpu   extras are comma-separated
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${1:-}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# The CPU build of torch 2.13.0 first: a looser requirement could pull a multi-GB CUDA build.
# On a GPU machine install the CUDA build of the same release first (see README), and this is a no-op.
.venv/bin/python -m pip install --quiet torch==2.13.0
if [ -n "$EXTRAS" ]; then
  .venv/bin/python -m pip install --quiet -e ".[${EXTRAS}]"
else
  .venv/bin/python -m pip install --quiet -e .
fi
# Compile the CPU kernels into numba's cache now (server/warm_kernels.py): otherwise the first
# serve waits ~45 s for the compiler, in every worker at once (~2 min here; ~20 s with a warm cache).
.venv/bin/ringserve warm-kernels
