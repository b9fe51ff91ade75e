"""The default detectors as a user meets them: a config file, a real torch loop, events back through
``on_anomaly``. The defaults run whatever ``anomaly.detectors`` lists, unless ``default_detectors: false``."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from trainmon import TrainerMonitor
from trainmon.anomaly.detectors import (
    ATTN_GROWTH_DEFAULT,
    DEFAULT_DETECTORS,
    EPS_LEVEL_DEFAULT,
    GRAD_NORM_DEFAULT,
    GRAD_NORM_DROP_DEFAULT,
    PER_LAYER_DEFAULT,
    ZERO_GRAD_DEFAULT,
)
from trainmon.anomaly.engine import AnomalyEngine
from trainmon.config import load_config

JUMP_AT = 60


def _prediction_and_target(model: nn.Module, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh batch of 64: the target is tanh(sum x) plus N(0, 0.3) noise."""
    x = torch.randn(64, 8, generator=generator)
    return model(x), x.sum(1, keepdim=True).tanh() + 0.3 * torch.randn(64, 1, generator=generator)


def _run(tmp_path: Path, anomaly_yaml: str, jump: float = 8.0, seed: int = 0) -> list[tuple[int, str, str]]:
    """80 Adam steps of a small MLP on fresh batches, configured from a YAML file; at ``JUMP_AT`` the loss
    is multiplied by ``jump`` before ``backward`` (so the global grad norm jumps ``jump``-fold) while the loss
    handed to the monitor is the plain one. Returns the events as (step, detector, name)."""
    name = f"s{seed}j{jump:g}{abs(hash(anomaly_yaml)) % 10_000}"
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"output_dir: {tmp_path}\nrun_name: {name}\nsinks: []\n"
                    f"anomaly:\n  actions: [callback]\n{anomaly_yaml}", encoding="utf-8")
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(100 + seed)
    monitor = TrainerMonitor(path)
    events = []
    monitor.on_anomaly(events.append)
    with monitor.attach(model, optimizer):
        for step in range(80):
            loss = nn.functional.mse_loss(*_prediction_and_target(model, generator))
            (loss * (jump if step == JUMP_AT else 1.0)).backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(loss=loss)
    return [(e.step, e.detector, e.name) for e in events]


def test_a_one_step_8x_grad_norm_jump_is_reported_by_default(tmp_path):
    for seed in range(3):
        assert _run(tmp_path, "", seed=seed) == [(JUMP_AT, "spike", "grad_norm")], seed
    assert _run(tmp_path, "", jump=1.0) == []  # the same run without the jump: nothing


def test_a_collapse_of_the_global_grad_norm_is_reported_by_default(tmp_path):
    # gradients x 1e-3 for one step (a loss-scale bug): the drop watch; the loss handed to the monitor is the plain one
    for seed in range(2):
        assert _run(tmp_path, "", jump=1e-3, seed=seed) == [(JUMP_AT, "spike", "grad_norm")], seed
    assert _run(tmp_path, "", jump=0.3, seed=0) == []  # a 3x smaller step is no collapse


def _zero_gradient_run(tmp_path: Path, name: str, make_loss, steps: int) -> tuple[list, list[float]]:
    """A user's loop with SGD; ``make_loss(model, x, y, step)``. Returns the events (step, detector, name, message)
    and, as the truth, the float64 norm over every parameter's ``p.grad`` the optimizer used at each step."""
    torch.manual_seed(0)
    model = nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": name, "sinks": [],
                              "anomaly": {"actions": ["callback"]}})
    events, norms = [], []
    monitor.on_anomaly(events.append)
    with monitor.attach(model, optimizer):
        for step in range(steps):
            x, y = torch.rand(32, 20), torch.rand(32, 1)
            optimizer.zero_grad()
            loss = make_loss(model, x, y, step)
            loss.backward()
            norms.append(sum(float(p.grad.double().square().sum()) for p in model.parameters()) ** 0.5)
            optimizer.step()
            monitor.step(loss=loss)
    return [(e.step, e.detector, e.name, e.message) for e in events], norms


def test_a_run_whose_gradients_are_all_zero_is_told_so_once(tmp_path):
    """pytorch/examples' ddp-tutorial-series as published: ``cross_entropy`` over the one output of ``Linear(20, 1)``
    is 0 whatever the weights, so nothing trains; every other default is silent on a flat 0."""
    events, norms = _zero_gradient_run(
        tmp_path, "one_class", lambda model, x, y, step: nn.functional.cross_entropy(model(x), y), 12)
    assert norms == [0.0] * 12  # the truth: every gradient the optimizer got was zero
    assert [event[:3] for event in events] == [(2, "level", "grad_norm")]
    assert "every gradient is zero" in events[0][3]


def test_gradients_collapsing_to_zero_mid_run_are_told_once_per_stretch(tmp_path):
    """A loss that stops depending on the weights for a while (steps 20-29, then again from 40): one event at the third
    zero of each stretch; the log watches cannot see a 0."""
    def loss(model, x, y, step):
        out = nn.functional.mse_loss(model(x), y)
        return out * 0.0 if 20 <= step < 30 or step >= 40 else out

    events, norms = _zero_gradient_run(tmp_path, "collapse", loss, 45)
    assert [step for step, norm in enumerate(norms) if norm == 0.0] == [*range(20, 30), *range(40, 45)]
    assert all(norm > 0 for norm in norms[:20])
    assert [event[:3] for event in events] == [(22, "level", "grad_norm"), (42, "level", "grad_norm")]


def test_user_detectors_are_added_to_the_defaults(tmp_path):
    user = "  detectors: [{type: spike, series: [loss]}]\n"
    # the user's spike on the loss did not switch off the grad-norm watch
    assert _run(tmp_path, user) == [(JUMP_AT, "spike", "grad_norm")]
    config = load_config({"anomaly": {"detectors": [{"type": "spike", "series": ["loss"]}]}})
    engine = AnomalyEngine(config.anomaly, rank=0, rank_dir=None)
    assert engine.specs == [*DEFAULT_DETECTORS, {"type": "spike", "series": ["loss"]}]
    assert [d.type_name for d in engine.detectors] == ["nonfinite", "loss_spike", "spike", "spike", "spike", "growth",
                                                       "level", "level", "spike"]


def test_default_detectors_false_runs_only_the_users(tmp_path):
    user = "  default_detectors: false\n  detectors: [{type: spike, series: [loss]}]\n"
    assert _run(tmp_path, user) == []
    mine = [{"type": "spike", "series": ["loss"]}]
    config = load_config({"anomaly": {"default_detectors": False, "detectors": mine}})
    assert AnomalyEngine(config.anomaly, rank=0, rank_dir=None).specs == mine
    nothing = load_config({"anomaly": {"default_detectors": False}})
    assert AnomalyEngine(nothing.anomaly, rank=0, rank_dir=None).detectors == []


def test_a_user_spec_on_a_default_series_replaces_that_default(tmp_path):
    # Two rules on grad_norm would report every jump twice: the user's replaces the default in place.
    mine = {"type": "spike", "series": ["grad_norm"], "method": "mad"}
    config = load_config({"anomaly": {"detectors": [{"type": "nonfinite", "scalars": ["loss"]}, mine]}})
    specs = AnomalyEngine(config.anomaly, rank=0, rank_dir=None).specs
    # both grad-norm defaults (the jump and the drop watch) share its series: the user's takes their place
    assert specs == [{"type": "nonfinite", "scalars": ["loss"]}, {"type": "loss_spike"}, PER_LAYER_DEFAULT, mine,
                     ATTN_GROWTH_DEFAULT, EPS_LEVEL_DEFAULT, ZERO_GRAD_DEFAULT]  # a level is not a spike: kept
    assert GRAD_NORM_DEFAULT not in specs and GRAD_NORM_DROP_DEFAULT not in specs
    # a growth or level spec replaces a default of its type only when it shares a series
    other = [{"type": "growth", "series": ["grad_norm"]}, {"type": "level", "series": ["loss"], "threshold": 9.0}]
    config = load_config({"anomaly": {"detectors": other}})
    assert AnomalyEngine(config.anomaly, rank=0, rank_dir=None).specs == [*DEFAULT_DETECTORS, *other]
    mine = {"type": "growth", "series": ["attn/*/max_logit"], "factor": 10.0}
    config = load_config({"anomaly": {"detectors": [mine]}})
    assert AnomalyEngine(config.anomaly, rank=0, rank_dir=None).specs == [
        spec if spec is not ATTN_GROWTH_DEFAULT else mine for spec in DEFAULT_DETECTORS]
    assert _run(tmp_path, "  detectors: [{type: spike, series: [grad_norm], method: log, "
                          "min_relative_change: 9.0, range_factor: 0}]\n") == []  # the user's 10x rule only


def test_run_json_records_the_detectors_that_run(tmp_path):
    """The merged list (defaults plus the user's) is what a reader of the run needs, not only the config keys."""
    import json

    import torch

    from trainmon import TrainerMonitor

    model = torch.nn.Linear(2, 1)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run",
                              "anomaly": {"detectors": [{"type": "spike", "series": ["loss"]}]}})
    monitor.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    monitor.close()
    detectors = json.loads((tmp_path / "run" / "run.json").read_text())["anomaly_detectors"]
    assert [spec["type"] for spec in detectors][:2] == ["nonfinite", "loss_spike"]
    assert {"type": "spike", "series": ["loss"]} in detectors and len(detectors) == len(DEFAULT_DETECTORS) + 1
