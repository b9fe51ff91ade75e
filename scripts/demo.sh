#!/usr/bin/env bash
# The demo: a light environment of its own, then a small GPT trains on CPU with the monitor and the
# demo shows what it found, where the output went and the tensorboard command to look at it.
#   .venv-demo: torch 2.13.0 (CPU build, pinned by constraints.txt), trainmon, tensorboard and crc32c
#   (tensorboardX's native checksum); none of the DeepSpeed, Megatron-Core or MindSpore test extras that
#   scripts/setup.sh puts in .venv. Idempotent: a second run skips the set-up. Arguments go to
#   examples/demo.py (--steps, --bad-step, --output-dir).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-demo
say() { echo "demo.sh: $*"; }
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV (torch, trainmon and tensorboard only)"
  "$PY" -m venv "$VENV"
fi
[ -e "$VENV/.gitignore" ] || echo '*' > "$VENV/.gitignore"   # the venv ignores itself (git status stays clean)
# torch first, alone and pinned (as scripts/setup.sh does): an unpinned resolve would pull the newest torch
# with gigabytes of CUDA packages.
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  say "installing torch 2.13.0 (CPU build) into $VENV; this can take a minute"
  "$VENV/bin/pip" install -q -c constraints.txt torch==2.13.0
fi
# (the trainmon command is the sign of trainmon's install: `import trainmon` would also find ./trainmon)
if [ ! -x "$VENV/bin/trainmon" ] || ! "$VENV/bin/python" -c "import tensorboard, crc32c" 2>/dev/null; then
  say "installing trainmon (editable) and tensorboard into $VENV"
  # compat: importable from any folder, also the one holding a clone named trainmon (see scripts/setup.sh)
  "$VENV/bin/pip" install -q -c constraints.txt --config-settings editable_mode=compat -e ".[view,fast-tensorboard]"
fi
say "$VENV is ready ($("$VENV/bin/python" -c 'import torch, trainmon; print(f"torch {torch.__version__}, trainmon {trainmon.__version__}")'))"
exec "$VENV/bin/python" examples/demo.py "$@"
