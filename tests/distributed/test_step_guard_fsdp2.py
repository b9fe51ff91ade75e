"""The step guard under FSDP2 (``fully_shard``) on 2 gloo ranks.

Each rank holds a shard of every gradient: the guard sums the shards' squared norms over the shard group with one
``all_reduce`` on the device, so every rank judges the whole gradients and reaches the same verdict. Rank 0 spikes
its loss at step ``SPIKE``, rank 1 makes its loss NaN at step ``NAN`` (both reach every shard through FSDP's
reduce-scatter). The truth is the same FSDP2 job without trainmon that leaves those batches out on every rank: each
rank's parameter and optimizer-state shards equal it bit for bit, with a fused (device flag, on DTensors) and a
foreach (host decision) optimizer.
"""

from __future__ import annotations

import json
import sys

import pandas as pd
import pytest

from tests.launch import run_ranks

STEPS, SPIKE, NAN = 9, 5, 7
KINDS = ("adam_fused", "adamw_foreach")


def _worker(out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from tests.integration.test_step_guard import OPTIMIZERS
    from tests.models import TinyNet, batch, loss_fn
    from trainmon import TrainerMonitor

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def train(kind: str, guarded: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = TinyNet()
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        optimizer = OPTIMIZERS[kind](model.parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        monitor = None
        if guarded:
            monitor = TrainerMonitor({"output_dir": out_dir, "run_name": kind, "sinks": ["csv"], "step_interval": 3,
                                      "anomaly": {"guard": {"enabled": True, "window": 8, "warmup": 4}}})
            monitor.attach(model, optimizer)
        try:
            for step in range(STEPS):
                if guarded or step not in (SPIKE, NAN):
                    loss = loss_fn(model, *batch(100 * rank + step))
                    if guarded and step == SPIKE and rank == 0:
                        loss = loss * 10
                    if guarded and step == NAN and rank == 1:
                        loss = loss * float("nan")
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                scheduler.step()
                if monitor is not None:
                    monitor.step(loss=loss)
        finally:
            if monitor is not None:
                monitor.close()
        return model, optimizer

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    try:
        for kind in KINDS:
            model, optimizer = train(kind, guarded=True)
            reference, reference_optimizer = train(kind, guarded=False)
            for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
                assert torch.equal(local(param), local(expected)), f"{kind}: shard of {name} differs"
            for param, expected in zip(model.parameters(), reference.parameters()):
                state, expected_state = optimizer.state[param], reference_optimizer.state[expected]
                assert state.keys() == expected_state.keys()
                for key, value in expected_state.items():
                    assert torch.equal(local(state[key]), local(value)), f"{kind}: state {key} differs"
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_every_rank_skips_the_poisoned_steps_as_a_job_without_their_batches(tmp_path):
    run_ranks([__file__, tmp_path], world_size=2, timeout=240)
    for kind in KINDS:
        for rank in range(2):
            scalars = pd.read_csv(tmp_path / kind / f"rank{rank}" / "scalars.csv")
            skipped = scalars[(scalars["name"] == "step_skipped") & (scalars["value"] == 1.0)]
            assert list(skipped["step"]) == [SPIKE, NAN], (kind, rank)
        # the whole gradients' norms: the same numbers on both ranks (their shards' norms differ)
        messages = [[json.loads(line)["message"].replace(f"rank {rank}", "rank R") for line in
                     (tmp_path / kind / f"rank{rank}" / "anomalies.jsonl").read_text().splitlines()
                     if json.loads(line)["detector"] == "step_guard"] for rank in range(2)]
        assert len(messages[0]) == 2 and messages[0] == messages[1], messages
        assert "(z_score): the gradient norm" in messages[0][0]


if __name__ == "__main__":
    _worker(sys.argv[1])
