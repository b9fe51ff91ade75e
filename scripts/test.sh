#!/usr/bin/env bash
# The test command: set up (idempotent), then run the tests in four lanes, in two environments.
#   1. .venv      every test (DeepSpeed, Megatron-Core, MindSpore; numpy<2 for MindSpore), slow
#                 multi-process tests included;
#   2. .venv      again, with every CPU tensor on the device path (see below);
#   2b. .venv     the monitored loops once more, through CUDA's Triton kernels in Triton's interpreter;
#   3. .venv-np2  numpy 2 and pandas 3 as users get them, torch and no other training framework: the
#                 tests not marked slow (the single-process framework-free and plain-torch ones; the
#                 DeepSpeed/Megatron/MindSpore ones skip there). The slow multi-process tests check
#                 process-group plumbing that numpy does not touch and would double this run's time.
# Arguments go to pytest in runs 1 and 3 instead (e.g. a test file: then the np2 run takes it as it is; runs 2
# and 2b are skipped). The exit code is 0 only when every run passes.
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

main_code=0 np2_code=0 device_code=0 triton_code=0
bash scripts/setup.sh main
lane main .venv "$@" || main_code=$?
# 2. .venv again, every CPU tensor on the device path (TRAINMON_TEST_DEVICE_PATH=1, tests/conftest.py): the
#    fused kernels and grouped activations that CUDA and Ascend run, under every single-process test
#    (`not slow`; multi-process tests start processes of their own, which keep the numpy path).
if [ $# -eq 0 ]; then
  TRAINMON_TEST_DEVICE_PATH=1 lane device-path .venv -m "not slow" || device_code=$?
  # 2b. The same with CUDA's kernels (TRAINMON_TEST_DEVICE_PATH=triton): the Triton launchers and kernels that
  #     a GPU runs, executed on the CPU tensors by Triton's interpreter (TRITON_INTERPRET=1), under the loops
  #     that check every family against float64. The interpreter is slow: these tests only (~5 min on 2 cores).
  if .venv/bin/python -c "import triton" 2>/dev/null; then
    TRAINMON_TEST_DEVICE_PATH=triton TRITON_INTERPRET=1 lane triton-interpreted .venv -m "not slow" \
      tests/loops tests/integration/test_torch_families.py tests/integration/test_grouped_activations.py \
      tests/integration/test_async_results.py::test_rows_equal_those_finished_at_once_and_records_come_one_step_later \
      tests/trainers/test_lightning.py || triton_code=$?
  else
    echo "=== tests: triton-interpreted: skipped (the triton package is not installed) ==="
  fi
fi
start=$SECONDS
if bash scripts/setup.sh np2; then
  echo "=== .venv-np2 set up in $((SECONDS - start)) s ==="
  if [ $# -eq 0 ]; then set -- -m "not slow"; fi
  lane np2 .venv-np2 "$@" || np2_code=$?
else
  np2_code=$?
  echo "=== .venv-np2 set-up failed (exit $np2_code) ==="
fi
echo "=== test.sh: main exit $main_code, device-path exit $device_code, triton-interpreted exit $triton_code," \
  "np2 exit $np2_code ==="
for code in $main_code $device_code $triton_code $np2_code; do
  if [ "$code" -ne 0 ]; then exit "$code"; fi
done
exit 0
