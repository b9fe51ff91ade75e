"""DeepSpeed ZeRO 1/2/3 with 2 ranks (gloo, CPU): shard statistics equal ZeRO-0's, rank attribution.

One ``torchrun`` pair trains every case in turn (a fresh engine per case, one process group), so
the whole file costs one launch. ZeRO-0 is checked against numpy float64 of the full tensors it
saved, and ZeRO 1/2/3 against ZeRO-0 (same seed and data, 1e-5 relative).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.reference import adam_update_np, np_stats, read_family
from trainmon.anomaly.analyse import analyse_run

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "distributed" / "scripts" / "ds_train.py"
METRICS = ["norm", "min", "max", "mean", "zeros", "nans", "infs"]
FAMILIES = ["grad_reduced", "exp_avg", "exp_avg_sq", "update", "ratio", "param"]
SUBSET = ["layers.*.fc*"]
NAN_PARAM = "layers.0.fc1.weight"
CASES = [
    {"name": "z0", "stage": 0, "ref": True},
    {"name": "z1", "stage": 1},
    {"name": "z2", "stage": 2},
    {"name": "z3", "stage": 3},
    {"name": "z0_gas", "stage": 0, "gas": 2},
    {"name": "z2_gas_subset", "stage": 2, "gas": 2, "params": SUBSET},
    {"name": "z3_gas_subset", "stage": 3, "gas": 2, "params": SUBSET},
    {"name": "z3_nan", "stage": 3, "nan_step": 1, "nan_param": NAN_PARAM},
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ds")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), str(SCRIPT), str(out), json.dumps(CASES)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out


def _table(run: Path, family: str) -> pd.DataFrame:
    return read_family(run / "rank0", family).set_index(["name", "step"]).sort_index()


def _assert_frames_close(got: pd.DataFrame, want: pd.DataFrame, label: str, rtol: float = 1e-5) -> None:
    assert list(got.index) == list(want.index), f"{label}: rows differ"
    for metric in METRICS:
        g, w = got[metric].to_numpy(float), want[metric].to_numpy(float)
        # a mean of a gradient that sums to ~0 (a softmax bias) is rounding noise: scale by the norm
        atol = 1e-7 * want["norm"].to_numpy(float) if metric == "mean" else 1e-9
        ok = np.isclose(g, w, rtol=rtol, atol=0.0, equal_nan=True) | (np.abs(g - w) <= atol)
        assert ok.all(), f"{label} {metric}: {list(got.index[~ok])[:3]} got {g[~ok][:3]} want {w[~ok][:3]}"


def test_zero0_matches_numpy(runs):
    run = runs / "z0"
    ref = np.load(run / "ref_rank0.npz")
    for family in FAMILIES:
        table = read_family(run / "rank0", family)
        assert len(table) == 3 * len(ref["names"]), family
        for _, row in table.iterrows():
            key = f"{row.step}/{{}}/{row['name']}"
            if family in ("grad_reduced", "param", "exp_avg", "exp_avg_sq"):
                array = ref[key.format(family)]
            else:
                update = adam_update_np(ref[key.format("exp_avg")], ref[key.format("exp_avg_sq")],
                                        float(ref[key.format("step")]), (0.9, 0.999), 1e-8)
                after = ref[key.format("param_after")]
                array = update if family == "update" else np.where(after != 0, update / np.where(after != 0, after, 1), 0)
            want = np_stats(array)
            for metric in METRICS:
                atol = 1e-7 * want["norm"] if metric == "mean" else 1e-7
                assert np.isclose(row[metric], want[metric], rtol=1e-5, atol=atol), (family, row["name"], metric)


@pytest.mark.parametrize("run", ["z1", "z2", "z3"])
def test_sharded_stages_equal_zero0(runs, run):
    for family in FAMILIES:
        want = _table(runs / "z0", family)
        _assert_frames_close(_table(runs / run, family), want, f"{run}/{family}")
    # replicated statistics are written by data-parallel rank 0 only; rank-local ones by both
    assert not (runs / run / "rank1" / "grad_reduced.csv").exists()
    unreduced = [read_family(runs / run / f"rank{r}", "grad_unreduced") for r in (0, 1)]
    assert not np.allclose(unreduced[0]["norm"], unreduced[1]["norm"])  # each rank its own gradient


def test_subset_with_accumulation_equals_zero0(runs):
    for run in ("z2_gas_subset", "z3_gas_subset"):
        for family in FAMILIES:
            got = _table(runs / run, family)
            names = sorted({name for name, _ in got.index})
            assert names and all(n.startswith("layers.") and ".fc" in n for n in names), names
            want = _table(runs / "z0_gas", family)
            # With accumulation ZeRO 2/3 sum micro-step gradients in another order than ZeRO-0 (reduce
            # per micro-step); ratio = update / param amplifies that rounding near param == 0.
            rtol = 1e-4 if family == "ratio" else 1e-5
            _assert_frames_close(got, want.loc[got.index], f"{run}/{family}", rtol)
        steps = pd.read_csv(runs / run / "rank0" / "scalars.csv")
        assert steps.loc[steps["name"] == "global_steps", "value"].tolist() == [1.0, 2.0, 3.0]


def test_nan_on_rank1_is_attributed_to_layer_and_rank(runs):
    run = runs / "z3_nan"
    rows = {r: read_family(run / f"rank{r}", "grad_unreduced") for r in (0, 1)}
    bad = rows[1][(rows[1]["nans"] > 0)]
    assert set(bad["name"]) == {NAN_PARAM} and set(bad["step"]) == {1}
    assert (rows[0]["nans"] == 0).all()  # rank 0 computed a clean gradient
    first = analyse_run(run)["first_origin"]  # the anomaly analysis over every rank's anomalies.jsonl
    assert (first["rank"], first["family"], first["name"], first["step"]) == (1, "grad_unreduced", NAN_PARAM, 1)
