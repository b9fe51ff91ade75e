#!/usr/bin/env bash
# The test command: set up (idempotent), then run the tests in two environments.
#   1. .venv      every test (DeepSpeed, Megatron-Core, MindSpore; numpy<2 for MindSpore), slow
#                 multi-process tests included;
#   2. .venv-np2  numpy 2 and pandas 3 as users get them, torch and no other training framework: the
#                 tests not marked slow (the single-process framework-free and plain-torch ones; the
#                 DeepSpeed/Megatron/MindSpore ones skip there). The slow multi-process tests check
#                 process-group plumbing that numpy does not touch and would double this run's time.
# Arguments go to pytest in both runs instead (e.g. a test file: then the np2 run takes it as it is).
# The exit code is 0 only when both runs pass.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} DS_ACCELERATOR=cpu

lane() {  # lane NAME VENV: run pytest in VENV; prints its closing line and time; returns pytest's code
  local name=$1 venv=$2 start=$SECONDS code=0
  shift 2
  echo "=== tests: $name ($("$venv/bin/python" -c 'import numpy, pandas; print(f"numpy {numpy.__version__}, pandas {pandas.__version__}")')) ==="
  "$venv/bin/python" -m pytest -q -rfEs -p no:cacheprovider "$@" || code=$?  # -rfEs: failures, errors and skip reasons
  echo "=== tests: $name: exit $code in $((SECONDS - start)) s ==="
  return $code
}

main_code=0 np2_code=0
bash scripts/setup.sh main
lane main .venv "$@" || main_code=$?
start=$SECONDS
if bash scripts/setup.sh np2; then
  echo "=== .venv-np2 set up in $((SECONDS - start)) s ==="
  if [ $# -eq 0 ]; then set -- -m "not slow"; fi
  lane np2 .venv-np2 "$@" || np2_code=$?
else
  np2_code=$?
  echo "=== .venv-np2 set-up failed (exit $np2_code) ==="
fi
echo "=== test.sh: main exit $main_code, np2 exit $np2_code ==="
exit $((main_code != 0 ? main_code : np2_code))
