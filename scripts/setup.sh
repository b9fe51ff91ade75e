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

# System packages the .venv tests use where they exist (Debian's, installed once where apt-get is available;
# a failure only says so, the test that needs the package skips and says why).
APT_UPDATED=0
apt_install() {  # apt_install PACKAGE PURPOSE TEST
  if [ "$VENV" != .venv ] || ! command -v apt-get >/dev/null 2>&1; then return 0; fi
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then sudo=(sudo -n); fi
  echo "setup.sh: installing $1 (apt-get) for $2" >&2
  { if [ "$APT_UPDATED" -eq 0 ]; then ${sudo[@]+"${sudo[@]}"} apt-get update -qq; fi && APT_UPDATED=1 \
    && DEBIAN_FRONTEND=noninteractive ${sudo[@]+"${sudo[@]}"} apt-get install -y -qq "$1"; } \
    >/dev/null 2>&1 || echo "setup.sh: $1 not installed; $3 will skip" >&2
}
# Chromium, for the browser test of `trainmon report`.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  apt_install chromium "the report's browser test" tests/integration/test_report_browser.py
fi
# A Java runtime, for Spark reading the run store (pyspark 4 needs Java 17+: Debian 12's default is 17).
if ! command -v java >/dev/null 2>&1; then
  apt_install default-jre-headless "the Spark test of the run store" "tests/integration/test_store_scale.py's Spark tests"
fi

# msprobe 1.2.1, the reference the msprobe tests compare with: downloaded and unpacked into .cache/ (cached,
# never installed into the venv). Without network the msprobe comparison test skips and says why.
bash scripts/fetch_msprobe.sh || echo "setup.sh: msprobe 1.2.1 not fetched; tests/integration/test_msprobe_compare.py will skip" >&2
