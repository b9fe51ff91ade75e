"""The step guard under DistributedDataParallel on 2 gloo ranks.

After DDP's all-reduce every rank holds the same gradients, so every rank reaches the same verdict without a
collective of the guard's own. Each rank trains on its own data; rank 0 spikes its loss at step ``SPIKE`` and rank 1
puts a NaN in one gradient at step ``NAN``: both poisons reach every rank through the reduction. The truth is the
same DDP job written without trainmon that leaves those two steps' batches out on every rank: the guarded job's
parameters and optimizer states equal it bit for bit on each rank, with a fused (device flag) and a foreach (host
decision) optimizer.
"""

from __future__ import annotations

import sys

import pandas as pd
import pytest
import torch

from tests.launch import run_ranks

STEPS, SPIKE, NAN = 9, 5, 7
KINDS = ("adam_fused", "adamw_foreach")


def _worker(out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from tests.integration.test_step_guard import OPTIMIZERS, _nan_in_one_entry, assert_bit_identical
    from tests.models import TinyNet, batch, loss_fn
    from trainmon import TrainerMonitor

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def train(kind: str, guarded: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = TinyNet()
        model = torch.nn.parallel.DistributedDataParallel(net)
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
                    handle = None
                    if guarded and step == NAN and rank == 1:
                        handle = net.layers[0].fc2.weight.register_hook(_nan_in_one_entry)
                    loss.backward()
                    if handle is not None:
                        handle.remove()
                    optimizer.step()
                    optimizer.zero_grad()
                scheduler.step()
                if monitor is not None:
                    monitor.step(loss=loss)
        finally:
            if monitor is not None:
                monitor.close()
        return net, optimizer

    try:
        for kind in KINDS:
            got = train(kind, guarded=True)
            assert_bit_identical(got, train(kind, guarded=False))
            # the ranks' parameters, compared by the test: a collective of the test's own as the worker's last act
            # can abort the process at exit (gloo's worker thread frees the finished work's Python tensors while
            # the interpreter finalises: "terminate called without an active exception", ~1 run in 12)
            flat = torch.cat([p.detach().reshape(-1) for p in got[0].parameters()])
            torch.save(flat, f"{out_dir}/{kind}_params_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_every_rank_skips_the_poisoned_steps_as_a_job_without_their_batches(tmp_path):
    run_ranks([__file__, tmp_path], world_size=2, timeout=180)
    for kind in KINDS:
        params = [torch.load(tmp_path / f"{kind}_params_rank{rank}.pt") for rank in range(2)]
        assert torch.equal(params[0], params[1]), f"{kind}: the ranks' parameters differ"
        for rank in range(2):
            scalars = pd.read_csv(tmp_path / kind / f"rank{rank}" / "scalars.csv")
            skipped = scalars[(scalars["name"] == "step_skipped") & (scalars["value"] == 1.0)]
            assert list(skipped["step"]) == [SPIKE, NAN], (kind, rank)
            events = (tmp_path / kind / f"rank{rank}" / "anomalies.jsonl").read_text()
            assert "layers.0.fc2.weight is not finite" in events


if __name__ == "__main__":
    _worker(sys.argv[1])
