#!/usr/bin/env bash
# Fetches msprobe 1.2.1 (the mindstudio-probe wheel, pure Python) and pytz, which its monitor imports, and
# unpacks them into .cache/msprobe-1.2.1/ for tests/integration/test_msprobe_compare.py. Nothing is installed:
# the test imports msprobe's monitor from that folder (torch_npu is never needed nor installed).
# Idempotent and cached: does nothing once the folder is complete. Exits 1 (with a message) when PyPI cannot
# be reached; the test then skips and says why.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.cache/msprobe-1.2.1
[ -f "$DEST/.complete" ] && exit 0
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
if ! "$PY" -m pip download -q --no-deps -d "$TMP/wheels" mindstudio-probe==1.2.1 pytz >"$TMP/log" 2>&1; then
  echo "fetch_msprobe.sh: cannot download mindstudio-probe==1.2.1 and pytz: $(tail -n 1 "$TMP/log")" >&2
  exit 1
fi
mkdir -p "$TMP/unpacked"
"$PY" - "$TMP/wheels" "$TMP/unpacked" <<'PYEOF'
import pathlib, sys, zipfile
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    zipfile.ZipFile(wheel).extractall(sys.argv[2])
PYEOF
mkdir -p .cache
rm -rf "$DEST"
mv "$TMP/unpacked" "$DEST"
touch "$DEST/.complete"
echo "fetch_msprobe.sh: msprobe 1.2.1 unpacked into $DEST"
