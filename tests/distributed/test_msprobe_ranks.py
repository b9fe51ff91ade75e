"""A msprobe config written for a larger job on 2 gloo ranks: ``module_ranks`` naming ranks the job does not have
runs on the listed ranks that exist (msprobe compares ``module_ranks`` with each rank, never with the world size),
with one warning; ``all_xy`` measures the root module. Values against float64 numpy of the tensors each rank used.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from tests.launch import run_ranks

STEPS = 2


def _worker(out_dir: str) -> None:
    import os

    import torch.distributed as dist

    from trainmon import TrainerMonitor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = Path(out_dir) / "monitor_config.json"
    os.environ["MONITOR_OUTPUT_DIR"] = str(Path(out_dir) / "out")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                                                          torch.nn.Linear(8, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = {}
    with TrainerMonitor.from_msprobe(config) as monitor:  # closed before the process group goes
        monitor.attach(model, optimizer)
        for step in range(STEPS):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * rank + step))
            inputs[str(step)] = x.double().numpy()
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    dist.destroy_process_group()
    np.savez(Path(out_dir) / f"inputs_rank{rank}.npz", **inputs)


@pytest.mark.slow
def test_module_ranks_of_a_larger_job_run_on_the_listed_ranks_that_exist(tmp_path: Path) -> None:
    (tmp_path / "monitor_config.json").write_text(json.dumps({
        "module_ranks": [1, 5, 6], "xy_distribution": True, "all_xy": True, "wg_distribution": True,
        "format": "csv", "ops": ["norm"]}))
    outputs = run_ranks([__file__, tmp_path], world_size=2, timeout=120)
    for output in outputs:  # each rank says so once
        assert output.count("ranks 5, 6 do not exist: this job has 2 ranks (0..1); collecting on rank 1 only") == 1
    (run_dir,) = (tmp_path / "out").iterdir()
    assert sorted(p.name for p in run_dir.iterdir() if p.is_dir()) == ["rank1"]  # rank 0 is not listed
    assert (run_dir / "run.json").exists()  # written by the first listed rank that exists
    actv = pd.read_csv(run_dir / "rank1" / "actv.csv")
    inputs = np.load(tmp_path / "inputs_rank1.npz")
    for step in range(STEPS):  # the root module's input: rank 1's own batch
        (norm,) = actv[(actv["name"] == ".input") & (actv["step"] == step)]["norm"]
        assert norm == pytest.approx(np.linalg.norm(inputs[str(step)]), rel=1e-6)
    assert {"0.weight", "2.bias"} <= set(pd.read_csv(run_dir / "rank1" / "grad_reduced.csv")["name"])


if __name__ == "__main__":
    _worker(sys.argv[1])
