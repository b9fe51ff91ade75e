"""2-worker msrun data-parallel MindSpore run: per-rank outputs that ``trainmon analyse`` reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mindspore")

from tests.launch import msrun, msrun_env
from tests.reference import read_family

ROOT = Path(__file__).parents[2]


@pytest.fixture(autouse=True)
def no_leftovers():
    """The training runs in msrun worker processes; nothing to check in this one."""
    yield


@pytest.mark.slow
def test_msrun_two_workers_per_rank_outputs_and_analyse(tmp_path: Path) -> None:
    out, logs = tmp_path / "out", tmp_path / "logs"
    cmd = msrun(ROOT / "tests/distributed/scripts/mindspore_dp_run.py", out, log_dir=logs)
    proc = subprocess.run(cmd, env=msrun_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    worker_logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(logs.glob("worker_*.log")))
    assert proc.returncode == 0, worker_logs or proc.stderr[-3000:]
    run_dir = out / "dp"
    for rank in (0, 1):
        grads = read_family(run_dir / f"rank{rank}", "grad_reduced")
        assert sorted(set(grads.step)) == [0, 1, 2]
    # after DistributedGradReducer both ranks step with the same (mean) gradient
    g0, g1 = (read_family(run_dir / f"rank{r}", "grad_reduced") for r in (0, 1))
    clean = g0.step == 0
    assert g0[clean]["norm"].tolist() == pytest.approx(g1[g1.step == 0]["norm"].tolist(), rel=1e-5)
    u0, u1 = (read_family(run_dir / f"rank{r}", "grad_unreduced") for r in (0, 1))
    assert u0[u0.step == 0]["norm"].tolist() != pytest.approx(u1[u1.step == 0]["norm"].tolist(), rel=1e-3)
    subprocess.run([sys.executable, "-m", "trainmon.tools.cli", "analyse", str(run_dir), "-o", str(tmp_path / "a")],
                   check=True, cwd=ROOT, capture_output=True)
    report = json.loads(next((tmp_path / "a").rglob("anomaly_analyse.json")).read_text())
    first = report["first_origin"]
    assert (first["rank"], first["step"], first["phase"], first["name"]) == (1, 1, "forward", "0.input")
