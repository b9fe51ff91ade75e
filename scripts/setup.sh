#!/usr/bin/env bash
# Creates .venv with torch 2.13.0 (CPU build) and trainmon with its test extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  .venv/bin/pip install -q torch==2.13.0
fi
# constraints.txt pins torch (so no extra resolves a newer CUDA build) and numpy<2 (MindSpore).
.venv/bin/pip install -q -c constraints.txt -e ".[test]"
