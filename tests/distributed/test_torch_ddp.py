"""torch DistributedDataParallel on 2 gloo ranks: gradients before and after the data-parallel reduction.

Each rank trains on its own data. The reference is independent of trainmon and of DDP: a plain copy
of the model, synced to DDP's weights before every step, gives each rank's local gradient in float64
numpy; the reduced gradient is their mean over the two ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.launch import run_ranks
from tests.reference import METRICS, assert_close, np_stats, read_family, read_rank_family

STEPS = 2


def _worker(out_dir: str) -> None:
    import copy

    import torch.distributed as dist

    from tests.models import TinyNet, batch, loss_fn
    from trainmon import TrainerMonitor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = TinyNet()
    reference = copy.deepcopy(net)
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMonitor({"output_dir": out_dir, "run_name": "run", "sinks": ["csv"],
                              "weight_grads": {"metrics": METRICS}, "optimizer_states": {"enabled": False}})
    monitor.attach(model, optimizer)
    local: dict[str, np.ndarray] = {}
    try:
        for step in range(STEPS):
            tokens, targets = batch(100 * rank + step)  # different data on each rank
            reference.load_state_dict(net.state_dict())
            grads = torch.autograd.grad(loss_fn(reference, tokens, targets), list(reference.parameters()))
            for (name, _), grad in zip(reference.named_parameters(), grads):
                local[f"{step}|{name}"] = grad.double().numpy()
            loss_fn(model, tokens, targets).backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    finally:
        monitor.close()
        dist.destroy_process_group()
    np.savez(Path(out_dir) / f"local_grads_rank{rank}.npz", **local)


@pytest.mark.slow
def test_ddp_unreduced_grads_are_local_and_reduced_grads_are_the_mean(tmp_path):
    run_ranks([__file__, tmp_path], world_size=2, timeout=120)
    local = [np.load(tmp_path / f"local_grads_rank{rank}.npz") for rank in range(2)]
    checked = 0
    for rank in range(2):
        rank_dir = tmp_path / "run" / f"rank{rank}"
        unreduced = read_family(rank_dir, "grad_unreduced")
        reduced = read_rank_family(rank_dir.parent, rank, "grad_reduced")  # written once, by rank 0
        for step in range(STEPS):
            for key in local[rank].files:
                if not key.startswith(f"{step}|"):
                    continue
                name = key.split("|", 1)[1]
                row = unreduced[(unreduced.step == step) & (unreduced.name == name)].iloc[0]
                assert_close(row, np_stats(local[rank][key]), METRICS, label=f"rank {rank} unreduced {key}")
                mean = (local[0][key] + local[1][key]) / 2
                row = reduced[(reduced.step == step) & (reduced.name == name)].iloc[0]
                assert_close(row, np_stats(mean), METRICS, label=f"rank {rank} reduced {key}")
                checked += 1
    assert checked > 20
    # the two ranks' local gradients differ (else the test could not tell reduced from unreduced)
    assert not np.allclose(local[0]["0|head.weight"], local[1]["0|head.weight"])


if __name__ == "__main__":
    _worker(sys.argv[1])
