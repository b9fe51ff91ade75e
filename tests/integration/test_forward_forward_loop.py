"""A layer trained as pytorch/examples' mnist_forward_forward trains it: an ``nn.Linear`` subclass with its own
optimizer, whose training loop calls ``self.forward(x)`` (no module hook runs) and whose ``predict`` afterwards calls
``layer(h)`` with grad enabled in training mode. One monitor per layer, as a user would attach it.

Before, with no ``monitor.step()``, nothing ended a step (steps end at the next iteration's forward of the attached
module, which never ran): every iteration was written as step 0 (its rows repeated, its activations named
``relu.call1`` ... ``relu.call30``). With ``monitor.step()``, the trailing ``predict`` forwards made a last step with
``step_skipped`` 1, though no step was skipped. The truth: the gradient norms and Adam moments the loop itself reads
(float64 numpy) at each of its optimizer steps.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from trainmon import TrainerMonitor

EPOCHS = 6


class Layer(nn.Linear):
    """pytorch/examples mnist_forward_forward's ``Layer`` (its ``train`` overrides ``nn.Module.train``)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.relu = torch.nn.ReLU()
        self.opt = torch.optim.Adam(self.parameters(), lr=0.03)
        self.threshold = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_direction = x / (x.norm(2, 1, keepdim=True) + 1e-4)
        return self.relu(torch.mm(x_direction, self.weight.T) + self.bias.unsqueeze(0))

    def train(self, x_pos, x_neg, monitor=None, truth=None):  # type: ignore[no-untyped-def, override]
        for _ in range(EPOCHS):
            g_pos = self.forward(x_pos).pow(2).mean(1)
            g_neg = self.forward(x_neg).pow(2).mean(1)
            loss = torch.log1p(torch.exp(torch.cat([-g_pos + self.threshold, g_neg - self.threshold]))).mean()
            self.opt.zero_grad()
            loss.backward()
            grads = {name: p.grad.detach().double().numpy().copy() for name, p in self.named_parameters()}
            self.opt.step()
            truth.append((grads, {name: self.opt.state[p]["exp_avg"].double().numpy().copy()
                                  for name, p in self.named_parameters()}, loss.item()))
            if monitor is not None:
                monitor.step(loss=loss)
        return self.forward(x_pos).detach(), self.forward(x_neg).detach()


def _norm(array: np.ndarray) -> float:
    return float(np.sqrt(np.sum(array * array)))


@pytest.mark.parametrize("interval", [1, 2], ids=["every_step", "every_2nd"])
@pytest.mark.parametrize("calls_step", [True, False], ids=["monitor_step", "optimizer_ends_steps"])
def test_a_layer_whose_forward_is_called_directly_has_one_step_per_optimizer_step(tmp_path, calls_step, interval):
    torch.manual_seed(1)
    layer = Layer(20, 8)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "ff", "sinks": ["csv"],
                              "step_interval": interval, "activations": {"enabled": True},
                              "optimizer_states": {"enabled": True, "states": ["exp_avg"]}})
    monitor.attach(layer, layer.opt)
    x = torch.randn(16, 20)
    truth: list = []
    layer.train(x, x.flip(0) * 0.5, monitor if calls_step else None, truth)
    layer(x).pow(2).mean(1)  # predict(): a forward with grad enabled, after training
    monitor.close()
    collected = list(range(0, EPOCHS, interval))
    rank = tmp_path / "ff" / "rank0"
    read = lambda family: pd.read_csv(rank / f"{family}.csv")  # noqa: E731
    grads, states, scalars = read("grad_reduced"), read("exp_avg"), read("scalars")
    assert sorted(set(grads.step)) == collected and sorted(set(states.step)) == collected
    for step in collected:
        want_grads, want_states, loss = truth[step]
        for frame, want in ((grads, want_grads), (states, want_states)):
            got = frame[frame.step == step].set_index("name")["norm"]
            assert len(got) == len(want), (step, got)  # one row per tensor: steps are not merged
            for name, array in want.items():
                assert got[name] == pytest.approx(_norm(array), rel=1e-5), (step, name)
        norms = scalars[(scalars.step == step) & (scalars.name == "grad_norm")]["value"]
        assert float(norms.iloc[0]) == pytest.approx(np.sqrt(sum(_norm(g) ** 2 for g in want_grads.values())),
                                                     rel=1e-5)
    losses = scalars[scalars.name == "loss"].set_index("step")["value"]
    if calls_step:  # every step's loss under its own step, the first one's too
        assert sorted(losses.index) == list(range(EPOCHS))
        assert [losses[s] for s in range(EPOCHS)] == pytest.approx([t[2] for t in truth], rel=1e-6)
    else:
        assert losses.empty
    activations = read("actv")
    relu = activations[activations.step < EPOCHS]
    assert set(relu.name) == {"relu.input", "relu.output", "relu.call1.input", "relu.call1.output"}
    assert "step_skipped" not in set(scalars.name)  # no step was skipped; the trailing forward's step never stepped


def test_monitored_forward_forward_training_is_bit_identical(tmp_path):
    results = []
    for monitored in (False, True):
        torch.manual_seed(1)
        layer = Layer(20, 8)
        monitor = None
        if monitored:
            monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "ff", "sinks": ["csv"],
                                      "step_interval": 2, "activations": {"enabled": True}})
            monitor.attach(layer, layer.opt)
        truth: list = []
        x = torch.randn(16, 20)
        layer.train(x, x.flip(0) * 0.5, None, truth)
        if monitor is not None:
            monitor.close()
        results.append((layer.state_dict(), [t[2] for t in truth]))
    assert results[0][1] == results[1][1]
    assert all(torch.equal(results[0][0][k], results[1][0][k]) for k in results[0][0])
