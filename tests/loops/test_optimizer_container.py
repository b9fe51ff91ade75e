"""torchtitan's ``OptimizersContainer`` (``tests/torchtitan_optimizer.py``) in a plain torch loop: the grad probe's
similarities with Adam's ``exp_avg`` come from the inner optimizers (the container's own ``state`` is empty).

The reference is the test's own: the gradients and every inner optimizer's ``exp_avg`` read in the container's
step pre-hook, in float64.
"""

from __future__ import annotations

import numpy as np
import torch

from tests.loops.common import MLP, config, data, scalars
from tests.torchtitan_optimizer import OptimizersContainer
from trainmon import TrainerMonitor

PARAM_GROUPS = [
    {"pattern": r"bias", "optimizer_name": "Adam", "optimizer_kwargs": {"lr": 1e-2}},
    {"pattern": r".*", "optimizer_name": "AdamW", "optimizer_kwargs": {"lr": 3e-2, "weight_decay": 0.1}},
]


def test_grad_probe_reads_exp_avg_from_the_inner_optimizers(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    optimizer = OptimizersContainer(PARAM_GROUPS, [model])
    seen: list[tuple[np.ndarray, np.ndarray | None]] = []

    def capture(opt, args, kwargs):  # registered before attach: runs before the probe's own pre-hook
        grads, moments = [], []
        for inner in opt.optimizers:
            for group in inner.param_groups:
                for p in group["params"]:
                    grads.append(p.grad.double().numpy().ravel())
                    state = inner.state.get(p)
                    moments.append(state["exp_avg"].double().numpy().ravel() if state else None)
        seen.append((np.concatenate(grads), None if moments[0] is None else np.concatenate(moments)))

    handle = optimizer.register_step_pre_hook(capture)
    monitor = TrainerMonitor(config(tmp_path, grad_probe={"enabled": True})).attach(model, optimizer)
    for step in range(3):
        x, y = data(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step()
    monitor.close()
    handle.remove()
    values = scalars(tmp_path)
    for step in (1, 2):  # step 0 has no exp_avg yet
        g, m = seen[step]
        want = float(g @ m / (np.linalg.norm(g) * np.linalg.norm(m)))
        assert np.isclose(values.loc[step, "grad_probe/cos_exp_avg"], want, atol=1e-5), (step, want)
