"""A GAN's loop, as pytorch/examples' dcgan writes it: one monitor per network (discriminator D, generator G), each
with its own optimizer. D is called three times an iteration, the third time for G's loss after D's optimizer
stepped. Before, that third call ended D's first step early, and every later step of D was numbered one too high
(its values right, under the wrong step).

The truth: the gradient norms the loop itself reads (float64 numpy) just before each optimizer step, and the
iteration count. With ``monitor.step()`` after each iteration and without it (the optimizer's step ends the step).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from trainmon import TrainerMonitor

ITERATIONS = 4


def _norms(model: nn.Module) -> dict[str, float]:
    return {name: float(np.linalg.norm(p.grad.detach().double().numpy())) for name, p in model.named_parameters()}


@pytest.mark.parametrize("calls_step", [True, False], ids=["monitor_step", "optimizer_ends_steps"])
def test_each_networks_steps_are_its_iterations_and_hold_its_gradients(tmp_path, calls_step):
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh())
    discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())
    criterion = nn.BCELoss()
    optimizer_d = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optimizer_g = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    monitors = {}
    for name, model, optimizer in (("D", discriminator, optimizer_d), ("G", generator, optimizer_g)):
        monitors[name] = TrainerMonitor({"output_dir": str(tmp_path), "run_name": name, "sinks": ["csv"],
                                         "activations": {"enabled": True}, "weight_grads": {"enabled": True}})
        monitors[name].attach(model, optimizer)
    truth: dict[str, list[dict[str, float]]] = {"D": [], "G": []}
    for _ in range(ITERATIONS):
        discriminator.zero_grad()
        real = torch.rand(6, 8) * 2 - 1
        error_real = criterion(discriminator(real).view(-1), torch.ones(6))
        error_real.backward()
        fake = generator(torch.randn(6, 4))
        error_fake = criterion(discriminator(fake.detach()).view(-1), torch.zeros(6))
        error_fake.backward()
        truth["D"].append(_norms(discriminator))
        optimizer_d.step()
        generator.zero_grad()
        error_g = criterion(discriminator(fake).view(-1), torch.ones(6))  # D again, after its optimizer stepped
        error_g.backward()
        truth["G"].append(_norms(generator))
        optimizer_g.step()
        if calls_step:
            monitors["D"].step(loss=error_real + error_fake)
            monitors["G"].step(loss=error_g)
    for monitor in monitors.values():
        monitor.close()
    for name, expected in truth.items():
        rows = pd.read_csv(tmp_path / name / "rank0" / "grad_reduced.csv")
        assert sorted(set(rows["step"])) == list(range(ITERATIONS)), name
        for step, norms in enumerate(expected):
            got = rows[rows["step"] == step].set_index("name")["norm"]
            for tensor, norm in norms.items():
                assert got[tensor] == pytest.approx(norm, rel=1e-5), (name, step, tensor)
        activations = pd.read_csv(tmp_path / name / "rank0" / "actv.csv")
        calls = 3 if name == "D" else 1  # every step holds all of its iteration's forwards
        assert set(activations.groupby("step")["micro_step"].nunique()) == {calls}, name
