"""``torch.distributed.checkpoint``'s optimizer state initialisation is not a training step.

``set_optimizer_state_dict`` (how pytorch/examples' FSDP2 example and torchtitan-style loops resume) calls
``_init_optim_state`` on an optimizer without state: ``optimizer.step()`` with zero gradients and lr 0. Attached
before the load, as such loops do, trainmon must neither count that call as a step (every later step would be one
off against the loop's own count) nor write rows for it. The truth is the loop's own count, its losses and the
value ``clip_grad_norm_`` returns.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from tests.loops.common import MLP, config, data, one_rank_gloo, rank_dir, rows
from trainmon import TrainerMonitor


def _train(model, optimizer, steps, monitor=None):
    losses, norms = {}, {}
    for step in steps:
        x, y = data(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the framework's own (pre-clip) norm
        norms[step] = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = float(loss.detach())
        if monitor is not None:
            monitor.step(loss=loss)
    return losses, norms


def _resume(tmp_path, model, start_step, guard):
    torch.manual_seed(0)
    first = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, first, range(3))
    saved = get_optimizer_state_dict(model, first)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # a fresh one, as a resumed job builds
    sections = {"optimizer_states": {"enabled": True}}
    if guard:
        sections["anomaly"] = {"guard": {"enabled": True}}
    monitor = TrainerMonitor(config(tmp_path, step_interval=1, **sections)).attach(model, optimizer,
                                                                                 start_step=start_step)
    set_optimizer_state_dict(model, optimizer, saved)  # _init_optim_state: a step with zero grads and lr 0
    losses, norms = _train(model, optimizer, range(start_step, start_step + 3), monitor)
    monitor.close()
    return losses, norms


def _check(tmp_path, losses, norms):
    frame = pd.read_csv(rank_dir(tmp_path) / "scalars.csv", keep_default_na=False, na_values=["nan"])
    table = frame.pivot(index="step", columns="name", values="value")
    assert list(table.index) == sorted(losses), table  # the loop's own steps, no extra one
    assert np.allclose(table["loss"].to_numpy(), [losses[s] for s in sorted(losses)], rtol=1e-6)
    assert np.allclose(table["grad_norm"].to_numpy(), [norms[s] for s in sorted(norms)], rtol=1e-5)
    assert (table["lr/group0"] == 1e-2).all()  # never the initialisation's lr 0
    for family in ("grad_reduced", "exp_avg"):
        counts = rows(tmp_path, family).groupby("step").size()
        assert list(counts.index) == sorted(losses) and (counts == 4).all(), (family, counts)  # 4 tensors, once


@pytest.mark.parametrize("guard", [False, True])
def test_resuming_with_dcp_counts_only_training_steps(tmp_path, guard):
    losses, norms = _resume(tmp_path, MLP(), start_step=3, guard=guard)
    _check(tmp_path, losses, norms)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")
def test_resuming_fsdp2_with_dcp_counts_only_training_steps(tmp_path):
    """The same under FSDP2 (``fully_shard`` on a 1-rank gloo group), as the FSDP2 example resumes."""
    from torch.distributed.fsdp import fully_shard

    with one_rank_gloo() as mesh:
        torch.manual_seed(0)
        model = MLP()
        fully_shard(model, mesh=mesh)
        losses, norms = _resume(tmp_path, model, start_step=0, guard=False)
    _check(tmp_path, losses, norms)
