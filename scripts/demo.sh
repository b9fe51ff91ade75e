#!/usr/bin/env bash
# The demo: set up (idempotent), then train a small GPT on CPU with the monitor and show what it found.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
