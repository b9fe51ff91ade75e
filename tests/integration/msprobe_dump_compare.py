"""Running msprobe 1.2.1's own accuracy compare on two trainmon dumps (a helper of the dump tests).

msprobe is unpacked (never installed) into ``.cache/msprobe-1.2.1`` by ``scripts/fetch_msprobe.sh``
(see ``tests/integration/test_msprobe_compare.py``). The compare runs in a child process with msprobe's
real code end to end (reading ``dump.json``, ``stack.json`` and the tensor files, matching operators,
statistics and tensor comparisons) except for two things this environment lacks: the final ``.xlsx``
writer (``openpyxl`` is not installed here; it is stubbed when missing and the result table is written as
CSV instead) and ``msprobe.mindspore``'s package ``__init__`` (it loads the dump debugger, which needs an
older MindSpore; the compare modules themselves load fine).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "msprobe-1.2.1"

RUNNER = textwrap.dedent('''
    import os, sys, types
    cache, framework, npu, bench, out = sys.argv[1:6]
    sys.path.insert(0, cache)
    try:
        import openpyxl  # noqa: F401
    except ImportError:  # only the xlsx writer needs it, and it is replaced below
        for name in ("openpyxl", "openpyxl.styles", "openpyxl.utils", "openpyxl.utils.dataframe"):
            sys.modules[name] = types.ModuleType(name)
        sys.modules["openpyxl.styles"].PatternFill = object
        sys.modules["openpyxl.utils.dataframe"].dataframe_to_rows = None
    import msprobe.core.compare.acc_compare as acc

    def to_csv(result_df, highlight_dict, file_path):
        result_df.to_csv(os.path.join(out, "compare_result.csv"), index=False)

    acc.highlight_rows_xlsx = to_csv
    params = {"npu_json_path": npu, "bench_json_path": bench, "is_print_compare_log": False}
    if framework == "pytorch":
        from msprobe.pytorch.compare.pt_compare import compare
        compare(params, out, auto_analyze=False)
    else:
        for name in ("msprobe.mindspore", "msprobe.mindspore.compare"):  # skip __init__: the dump debugger
            package = types.ModuleType(name)
            package.__path__ = [os.path.join(cache, *name.split("."))]
            sys.modules[name] = package
        import msprobe.mindspore.compare.ms_compare as ms_compare
        ms_compare.highlight_rows_xlsx = to_csv
        ms_compare.ms_compare(params, out, auto_analyze=False)
''')


def require_msprobe() -> None:
    """Skip (saying why) when msprobe 1.2.1 cannot be fetched into the cache."""
    from tests.integration.test_msprobe_compare import _msprobe_available

    reason = _msprobe_available()
    if reason:
        pytest.skip(reason)


def compare_dumps(npu: Path, bench: Path, out: Path, framework: str = "pytorch") -> pd.DataFrame:
    """msprobe's compare of the dump directories ``npu`` and ``bench`` (each with a ``dump.json``).

    Returns:
        msprobe's result table (one row per compared tensor: names, dtypes, shapes, statistics of both
        sides, cosine and error measures in tensor mode, ``Err_message``).
    """
    require_msprobe()
    out.mkdir(parents=True, exist_ok=True)
    (out / "runner.py").write_text(RUNNER)
    result = subprocess.run([sys.executable, str(out / "runner.py"), str(CACHE), framework, str(npu / "dump.json"),
                             str(bench / "dump.json"), str(out)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    if result.returncode != 0 and "ModuleNotFoundError" in result.stderr:
        pytest.skip(f"msprobe 1.2.1's compare cannot be imported here: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, result.stderr[-3000:]
    return pd.read_csv(out / "compare_result.csv", keep_default_na=False)
