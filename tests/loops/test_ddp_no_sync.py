"""Gradient accumulation under torch DDP with ``no_sync`` on 2 gloo ranks (the standard recipe).

Reference, independent of trainmon and of DDP: a plain copy of the model gives each rank's local
accumulated gradient in float64; the reduced gradient is the mean over the ranks, and grad_norm its norm
(read at the end of the backward pass, after DDP's reduction, so it must match the mean's norm exactly).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tests.launch import run_ranks
from tests.reference import METRICS, assert_close, np_stats, read_family, read_rank_family

STEPS, MICRO = 2, 2


def _worker(out_dir: str) -> None:
    import copy

    import torch
    import torch.distributed as dist

    from tests.loops.common import MLP, data, grads64
    from trainmon import TrainerMonitor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = MLP()
    reference = copy.deepcopy(net)
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMonitor({"output_dir": out_dir, "run_name": "run", "sinks": ["csv"],
                              "weight_grads": {"metrics": METRICS}})
    monitor.attach(model, optimizer, grad_acc_steps=MICRO)
    local: dict[str, np.ndarray] = {}
    try:
        for step in range(STEPS):
            reference.load_state_dict(net.state_dict())
            reference.zero_grad()
            for micro in range(MICRO):
                x, y = data(1000 * rank + 10 * step + micro)  # different data on each rank
                torch.nn.functional.mse_loss(reference(x), y).div(MICRO).backward()
                if micro < MICRO - 1:
                    with model.no_sync():
                        torch.nn.functional.mse_loss(model(x), y).div(MICRO).backward()
                else:
                    torch.nn.functional.mse_loss(model(x), y).div(MICRO).backward()
            for name, grad in grads64(reference).items():
                local[f"{step}|{name}"] = grad
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    finally:
        monitor.close()
        dist.destroy_process_group()
    np.savez(Path(out_dir) / f"local_grads_rank{rank}.npz", **local)


@pytest.mark.slow
def test_no_sync_accumulation_unreduced_local_reduced_mean_and_norm_after_reduction(tmp_path):
    run_ranks([__file__, tmp_path], world_size=2, timeout=120)
    local = [np.load(tmp_path / f"local_grads_rank{rank}.npz") for rank in range(2)]
    for rank in range(2):
        rank_dir = tmp_path / "run" / f"rank{rank}"
        # grad_reduced is the same on both ranks: written once, by rank 0 (write_replicated_once)
        unreduced, reduced = read_family(rank_dir, "grad_unreduced"), read_rank_family(rank_dir.parent, rank,
                                                                                       "grad_reduced")
        assert (rank_dir / "grad_reduced.csv").exists() == (rank == 0)
        assert set(unreduced.micro_step) == {MICRO - 1}
        scalars = read_family(rank_dir, "scalars")
        for step in range(STEPS):
            squares = 0.0
            for key in (k for k in local[rank].files if k.startswith(f"{step}|")):
                name = key.split("|", 1)[1]
                row = unreduced[(unreduced.step == step) & (unreduced.name == name)].iloc[0]
                assert_close(row, np_stats(local[rank][key]), METRICS, label=f"rank {rank} unreduced {key}")
                mean = (local[0][key] + local[1][key]) / 2
                row = reduced[(reduced.step == step) & (reduced.name == name)].iloc[0]
                assert_close(row, np_stats(mean), METRICS, label=f"rank {rank} reduced {key}")
                squares += float(np.sum(mean * mean))
            norm = scalars[(scalars.step == step) & (scalars.name == "grad_norm")]["value"].iloc[0]
            assert np.isclose(norm, np.sqrt(squares), rtol=1e-5), (rank, step, norm, np.sqrt(squares))
    assert not np.allclose(local[0]["0|fc1.weight"], local[1]["0|fc1.weight"])


if __name__ == "__main__":
    _worker(sys.argv[1])
