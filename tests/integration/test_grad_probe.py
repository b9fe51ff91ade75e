"""Grad probe end to end through TrainerMonitor, and `trainmon grad-compare` on the runs it wrote."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from torch import nn

from trainmon import TrainerMonitor
from trainmon.tools.cli import main as cli_main


class TwoTowers(nn.Module):
    """A two-layer tower and a one-layer tower whose losses add: a tower's gradients never depend on
    the other's weights, so re-seeding layer ``b`` may change the gradients of ``b`` only."""

    def __init__(self, seed_b: int) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        self.target = torch.randn(8, 32)
        torch.manual_seed(seed_b)
        self.b = nn.Linear(8, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).square().mean() + (self.b(x) - self.target).square().mean()


def _train(tmp_path, run_name: str, seed_b: int, steps: int = 4) -> tuple[TrainerMonitor, list[dict]]:
    model = TwoTowers(seed_b)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = {"output_dir": str(tmp_path), "run_name": run_name, "sinks": ["csv"],
              "weight_grads": {"enabled": False}, "optimizer_states": {"enabled": False},
              "grad_probe": {"enabled": True, "level": "L2", "bounds": [-0.01, 0.0, 0.01]}}
    grads: list[dict] = []
    handle = optimizer.register_step_pre_hook(
        lambda opt, a, k: grads.append({n: p.grad.double().numpy().copy() for n, p in model.named_parameters()}))
    data = torch.randn(32, 8, generator=torch.Generator().manual_seed(5))
    monitor = TrainerMonitor(config).attach(model, optimizer)
    with monitor:
        for step in range(steps):
            model(data[step * 8:(step + 1) * 8]).backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    handle.remove()
    return monitor, grads


def test_summary_numbers_and_cross_run_comparison(tmp_path, capsys):
    _, grads = _train(tmp_path, "base", seed_b=2)
    _train(tmp_path, "other_b", seed_b=3)  # tower b initialised with another seed
    summary = pd.read_csv(tmp_path / "base/rank0/grad_probe/grad_summary.csv", keep_default_na=False, na_values=["nan"])
    assert len(summary) == 4 * 6 and sorted(summary["step"].unique()) == [0, 1, 2, 3]
    for _, row in summary.iterrows():
        g = grads[row["step"]][row["name"]].ravel()
        assert np.isclose(row["norm"], np.linalg.norm(g), rtol=1e-5)
        assert np.isclose(row["(-inf, -0.01]"], np.mean(g <= -0.01), atol=1e-6)
        assert np.isclose(row["(0, 0.01]"], np.mean((g > 0) & (g <= 0.01)), atol=1e-6)
        if row["step"] > 0:
            prev = grads[row["step"] - 1][row["name"]].ravel()
            assert np.isclose(row["sign_agree_prev"], np.mean((g > 0) == (prev > 0)), atol=1e-6)

    same = tmp_path / "same"
    assert cli_main(["grad-compare", str(tmp_path / "base"), str(tmp_path / "base"), "-o", str(same)]) == 0
    sims = pd.read_csv(same / "similarities.csv")
    assert (sims["similarity"] == 1.0).all() and set(sims["kind"]) == {"param", "element_weighted", "param_averaged"}
    assert (same / "similarity_heatmap_rank0.png").stat().st_size > 0
    assert (same / "similarity_lines_rank0.png").stat().st_size > 0

    diff = tmp_path / "diff"
    assert cli_main(["grad-compare", str(tmp_path / "base"), str(tmp_path / "other_b"), "-o", str(diff)]) == 0
    sims = pd.read_csv(diff / "similarities.csv")
    params = sims[sims["kind"] == "param"]
    tower_a, tower_b = params[params["name"].str.startswith("a.")], params[params["name"].str.startswith("b.")]
    assert len(tower_a) == 16 and len(tower_b) == 8
    assert (tower_a["similarity"] == 1.0).all()
    assert (tower_b["similarity"] < 1.0).all()
    summary_rows = sims[sims["kind"] == "element_weighted"]
    assert len(summary_rows) == 4 and (summary_rows["similarity"] < 1.0).all()
    capsys.readouterr()


def test_unsafe_parameter_names_give_files_in_the_step_directory(tmp_path, capsys):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("w/x", nn.Linear(4, 3))  # torch allows "/" in module names
    model.add_module("plain", nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": [], "weight_grads": {"enabled": False},
              "optimizer_states": {"enabled": False}, "grad_probe": {"enabled": True, "level": "L1"}}
    x = torch.randn(5, 4)
    with TrainerMonitor(config).attach(model, optimizer) as monitor:
        for _ in range(2):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    probe_dir = tmp_path / "run" / "rank0" / "grad_probe"
    files = sorted(p.relative_to(probe_dir) for p in probe_dir.rglob("*.bits"))
    assert len(files) == 2 * 4 and all(len(p.parts) == 2 for p in files), files  # step{S}/{file}: no subfolder
    assert {p.name for p in files if p.name.startswith("plain")} == {"plain.weight.bits", "plain.bias.bits"}
    assert not list(probe_dir.rglob("*.partial"))  # atomic writes leave no temporary file
    out = tmp_path / "cmp"
    assert cli_main(["grad-compare", str(tmp_path / "run"), str(tmp_path / "run"), "-o", str(out), "--no-plots"]) == 0
    table = pd.read_csv(out / "similarities.csv")
    params = table[table["kind"] == "param"]
    assert sorted(set(params["name"])) == ["plain.bias", "plain.weight", "w/x.bias", "w/x.weight"]
    assert (params["similarity"] == 1.0).all() and len(params) == 8
    assert not (out / "problems.txt").exists()
