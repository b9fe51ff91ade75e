"""MindSpore collectives under msrun (2 workers): ``comm`` rows equal float64 references of what was sent
and received, and every wrapped function and primitive class is restored at close."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("mindspore")

from tests.launch import msrun, msrun_env
from tests.reference import read_family

ROOT = Path(__file__).parents[2]
METRICS = ("norm", "min", "max", "mean", "nans")


@pytest.fixture(autouse=True)
def no_leftovers():
    """The training runs in msrun worker processes; nothing to check in this one."""
    yield


@pytest.mark.slow
def test_msrun_collectives_match_float64_references(tmp_path: Path) -> None:
    out, logs = tmp_path / "out", tmp_path / "logs"
    cmd = msrun(ROOT / "tests/distributed/scripts/mindspore_comm_run.py", out, log_dir=logs)
    proc = subprocess.run(cmd, env=msrun_env(), cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    worker_logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(logs.glob("worker_*.log")))
    assert proc.returncode == 0, worker_logs or proc.stderr[-3000:]
    checked = 0
    for rank in (0, 1):
        refs = json.loads((out / f"refs_rank{rank}.json").read_text())
        assert refs["world"] == 2 and all(refs["restored"].values()), refs["restored"]
        rows = read_family(out / "comm" / f"rank{rank}", "comm")
        for step, expected in refs["steps"].items():
            mine = rows[rows.step == int(step)].set_index("name")
            assert sorted(mine.index) == sorted(expected), (rank, step)
            for name, ref in expected.items():
                for metric in METRICS:
                    got, want = float(mine.loc[name, metric]), ref[metric]
                    if math.isnan(want):
                        assert math.isnan(got), (rank, step, name, metric)
                    else:
                        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (rank, step, name, metric, got, want)
                    checked += 1
        scalars = read_family(out / "comm" / f"rank{rank}", "scalars")
        calls = scalars[(scalars.step == 0) & (scalars.name == "comm/all_reduce.g0-1/calls")]["value"]
        assert calls.tolist() == [4.0]  # two mint.distributed calls (one async), the primitive, ops.all_reduce
    assert checked > 200
    # the NaN rank 1 sends at step 1 is in its pre row and in both ranks' post rows
    for rank in (0, 1):
        rows = read_family(out / "comm" / f"rank{rank}", "comm").set_index(["step", "name"])
        assert rows.loc[(1, "all_reduce.g0-1.call0.post.0"), "nans"] == 1.0
        assert rows.loc[(1, "all_reduce.g0-1.call0.pre.0"), "nans"] == (1.0 if rank == 1 else 0.0)
