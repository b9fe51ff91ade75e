#!/usr/bin/env bash
# Creates a virtual environment with torch 2.13.0 (CPU build) and trainmon installed. Idempotent.
#   bash scripts/setup.sh        .venv: the test extras (DeepSpeed, Megatron-Core, MindSpore), numpy<2
#   bash scripts/setup.sh np2    .venv-np2: what the framework-free and plain-torch tests need, with
#                                numpy 2 and pandas 3 as users get them (no DeepSpeed, Megatron, MindSpore)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
case "${1:-main}" in
  main) VENV=.venv CONSTRAINTS=constraints.txt PACKAGES=(-e ".[test]") ;;
  np2) VENV=.venv-np2 CONSTRAINTS=constraints-np2.txt
       PACKAGES=(-e ".[fast-tensorboard,plots]" pytest hypothesis tensorboard pandas) ;;
  *) echo "usage: bash scripts/setup.sh [main|np2]" >&2; exit 2 ;;
esac
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
[ -e "$VENV/.gitignore" ] || echo '*' > "$VENV/.gitignore"   # the venv ignores itself (git status stays clean)
# torch first, alone: pinned, it is the CPU build from the local wheel folder in seconds. Any later
# install that resolved torch unpinned would pull the newest torch with gigabytes of CUDA packages.
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  "$VENV/bin/pip" install -q torch==2.13.0
fi
# The constraints file keeps torch at 2.13.0 for every package that asks for torch; constraints.txt adds
# numpy<2 (MindSpore), constraints-np2.txt numpy>=2 and pandas>=3.
# editable_mode=compat: the checkout goes on sys.path through a .pth file, so `import trainmon` finds the package
# even from the folder that holds a clone named trainmon (setuptools' default editable finder comes after the
# path finder there, and the clone folder itself would be imported as an empty namespace package).
"$VENV/bin/pip" install -q -c "$CONSTRAINTS" --config-settings editable_mode=compat "${PACKAGES[@]}"

# Chromium, for the browser test of `trainmon report` (tests/integration/test_report_browser.py skips without
# it): Debian's package, installed once where apt-get is available; a failure only says so.
if [ "$VENV" = .venv ] && ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
    && command -v apt-get >/dev/null 2>&1; then
  SUDO=()
  if [ "$(id -u)" -ne 0 ]; then SUDO=(sudo -n); fi
  echo "setup.sh: installing chromium (apt-get) for the report's browser test" >&2
  { ${SUDO[@]+"${SUDO[@]}"} apt-get update -qq && DEBIAN_FRONTEND=noninteractive ${SUDO[@]+"${SUDO[@]}"} apt-get install -y -qq chromium; } \
    >/dev/null 2>&1 || echo "setup.sh: chromium not installed; tests/integration/test_report_browser.py will skip" >&2
fi

# msprobe 1.2.1, the reference the msprobe tests compare with: downloaded and unpacked into .cache/ (cached,
# never installed into the venv). Without network the msprobe comparison test skips and says why.
bash scripts/fetch_msprobe.sh || echo "setup.sh: msprobe 1.2.1 not fetched; tests/integration/test_msprobe_compare.py will skip" >&2
