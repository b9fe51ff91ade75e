#!/usr/bin/env bash
# The checks that need a CUDA GPU (CI has none): the GPU tests and the step-time overhead on CUDA.
#   bash scripts/gpu_check.sh            (on a machine with a CUDA GPU, torch and Triton installed;
#                                         logs go to $OUT when it is set, else to ./gpu_check/)
# 1. tests/gpu: the Triton kernels and monitored fp32/bf16 runs against float64 references, and one
#    synchronisation per collected step by CUDA's own sync detector;
# 2. benchmarks/kernel_bandwidth.py: the statistics kernels' TB/s against torch._foreach_norm;
# 3. benchmarks/overhead.py on a 1.14 B-parameter bf16 GPT (the README's GPU figures), then on the
#    4-layer d=256 GPT.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${OUT:-gpu_check}
mkdir -p "$LOGS"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"
code=0
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -rfEs tests/gpu 2>&1 | tee "$LOGS/pytest_gpu.log" || code=1
timeout 120 "$PY" benchmarks/kernel_bandwidth.py 2>&1 | tee "$LOGS/kernel_bandwidth.txt" || code=1
timeout 240 "$PY" benchmarks/overhead.py --device cuda --model 1b --dtype bfloat16 --rounds 3 --steps 8 --skip-memory \
  --cases none weights activations uncollected weights_async activations_async 2>&1 | tee "$LOGS/overhead_1b_bf16.txt" || code=1
timeout 120 "$PY" benchmarks/overhead.py --device cuda --rounds 3 --steps 10 --skip-memory \
  --cases none weights activations uncollected 2>&1 | tee "$LOGS/overhead_gpt_fp32.txt" || code=1
exit $code
