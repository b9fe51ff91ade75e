"""torch.compile and trainer wrappers: accelerate's optimizer (what Hugging Face callbacks receive)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from tests.loops.common import MLP, assert_rows_match, config, data, global_norm, grads64, rows, scalars
from tests.reference import METRICS
from trainmon import TrainerMonitor

ACTIVATIONS = {"enabled": True, "metrics": METRICS}


def _compile_works() -> bool:
    try:
        torch.compile(torch.nn.Linear(2, 2), backend="aot_eager")(torch.ones(1, 2))
        return True
    except Exception:  # a capability probe
        return False


needs_compile = pytest.mark.skipif(not _compile_works(), reason="torch.compile (aot_eager) does not run here")


def _train(model, optimizer, monitor, steps, used):
    for step in range(steps):
        x, y = data(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        used[step] = grads64(getattr(model, "_orig_mod", model))
        optimizer.step()
        optimizer.zero_grad()
        monitor.step()


@needs_compile
def test_compiled_model_rows_carry_no_orig_mod_and_activations_warn_once(tmp_path, caplog):
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = config(tmp_path, step_interval=2, activations=ACTIVATIONS, targets={"modules": ["fc1", "fc2"]})
    used = {}
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        monitor = TrainerMonitor(cfg).attach(compiled, optimizer)
        _train(compiled, optimizer, monitor, 6, used)
        monitor.close()
    warnings = [r for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(warnings) == 1 and "not recorded" in warnings[0].getMessage()
    reduced = rows(tmp_path, "grad_reduced")
    assert not any("_orig_mod" in name for name in reduced.name)
    assert sorted(set(reduced.step)) == [0, 2, 4]
    for step in (0, 2, 4):
        assert_rows_match(reduced, step, used[step])
    assert not (tmp_path / "run" / "rank0" / "actv.csv").exists()


@needs_compile
def test_compiled_submodule_keeps_the_other_activations_on_every_collected_step(tmp_path, caplog):
    torch.manual_seed(0)
    model = MLP()
    model.fc2 = torch.compile(model.fc2, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = config(tmp_path, step_interval=2, activations=ACTIVATIONS)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        monitor = TrainerMonitor(cfg).attach(model, optimizer)
        _train(model, optimizer, monitor, 6, {})
        monitor.close()
    assert sorted(set(rows(tmp_path, "grad_reduced").name)) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    actv = rows(tmp_path, "actv")
    for step in (0, 2, 4):
        names = set(actv[actv.step == step].name)
        assert {"fc1.output", "act.output"} <= names, (step, names)
        assert not any(name.startswith("fc2") for name in names)
    assert any("fc2" in r.getMessage() for r in caplog.records if "torch.compile" in r.getMessage())


def test_accelerate_optimizer_is_unwrapped_with_its_scaler(tmp_path):
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")
    from accelerate.optimizer import AcceleratedOptimizer

    torch.manual_seed(0)
    model = MLP()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    accelerator = accelerate.Accelerator(cpu=True)
    optimizer = AcceleratedOptimizer(inner, device_placement=False, scaler=scaler)
    monitor = TrainerMonitor(config(tmp_path)).attach(model, optimizer)  # the scaler is found behind it
    used, norms = {}, {}
    handle = inner.register_step_pre_hook(lambda opt, a, k: used.__setitem__(step, grads64(model)))
    for step in range(3):
        x, y = data(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(scaler.scale(loss))
        norms[step] = global_norm(grads64(model, divide=scaler.get_scale()))
        optimizer.step()   # AcceleratedOptimizer: scaler.step(inner) and scaler.update()
        optimizer.zero_grad()
    monitor.close()
    handle.remove()
    reduced, values = rows(tmp_path, "grad_reduced"), scalars(tmp_path)
    assert list(values.index) == [0, 1, 2]
    for step in range(3):
        assert_rows_match(reduced, step, used[step])
        assert np.isclose(values.loc[step, "grad_norm"], norms[step], rtol=1e-5)
        assert values.loc[step, "loss_scale"] == 2.0 ** 8 and values.loc[step, "step_skipped"] == 0.0
