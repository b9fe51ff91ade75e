"""A Megatron-Core model with a plain torch optimizer (NVIDIA's simple train loop): the torch collectors
give grad_reduced, param, Adam states and grad_norm, equal to the gradients the optimizer used."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.launch import child_env, free_port
from tests.reference import np_stats, read_family

SCRIPT = Path(__file__).parent / "scripts" / "mcore_torch_adam.py"


@pytest.mark.slow
def test_megatron_model_with_torch_adam(tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    env = child_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], env=env, text=True, capture_output=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    used = np.load(tmp_path / "used.npz")
    rank_dir = tmp_path / "run" / "rank0"
    reduced = read_family(rank_dir, "grad_reduced")
    scalars = read_family(rank_dir, "scalars")
    assert (rank_dir / "param.csv").exists() and (rank_dir / "exp_avg.csv").exists()
    for step in range(3):
        keys = [k for k in used.files if k.startswith(f"{step}|")]
        assert len(keys) > 10
        for key in keys:
            name = key.split("|", 1)[1]
            row = reduced[(reduced.step == step) & (reduced.name == name)].iloc[0]
            want = np_stats(used[key])
            for metric in ("norm", "min", "max", "mean"):
                assert np.isclose(row[metric], want[metric], rtol=1e-5, atol=1e-7), (key, metric)
        norm = np.sqrt(sum(np.sum(used[k] ** 2) for k in keys))
        got = scalars[(scalars.step == step) & (scalars.name == "grad_norm")]["value"].iloc[0]
        assert np.isclose(got, norm, rtol=1e-5)
