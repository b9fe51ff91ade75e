#!/usr/bin/env bash
# The test command: set up (idempotent), then run the whole suite, slow multi-process tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} DS_ACCELERATOR=cpu
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
