#!/usr/bin/env bash
# The style checks CI runs before the tests (.ci/run): ruff (rules in pyproject.toml's [tool.ruff]) on the
# code, mypy --strict on trainmon/ ([tool.mypy]), then the doctests of trainmon/. Needs .venv
# (bash scripts/setup.sh main; ruff and mypy are in the test extra).
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
echo "=== lint: ruff ==="
"$python" -m ruff check trainmon tests benchmarks examples
echo "=== lint: mypy (strict) on trainmon/ ==="
"$python" -m mypy
echo "=== lint: doctests of trainmon/ ==="
ignore=()
# The Triton kernels import triton at module level: only where it is installed (a CUDA machine).
"$python" -c "import triton" 2>/dev/null || ignore+=(--ignore=trainmon/collect/triton_kernels.py)
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} DS_ACCELERATOR=cpu \
  "$python" -m pytest -q -p no:cacheprovider --doctest-modules ${ignore[@]+"${ignore[@]}"} trainmon
