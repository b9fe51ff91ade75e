"""Parameters that are not finite before the first update (a model built on the meta device whose
``reset_parameters()`` misses a module, as pytorch/examples' FSDP2 example does; a checkpoint saved after a NaN
step) are the first origin of the run's non-finite values, named as such, with no host synchronisation added.
The truth is the test's own count of the NaN and Inf values in a float64 copy of the tensors taken before
training."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tests.integration.test_torch_lifecycle import _TransferCounter
from tests.loops.common import MLP, config, data, one_rank_gloo, rank_dir
from trainmon import TrainerMonitor
from trainmon.collect import param_check


def _events(tmp_path) -> list[dict]:
    path = rank_dir(tmp_path) / "anomalies.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _train(model, tmp_path, steps=3, start_step=0, **sections):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = config(tmp_path, activations={"enabled": True}, **sections)
    monitor = TrainerMonitor(cfg).attach(model, optimizer, start_step=start_step)
    transfers = []
    for step in range(start_step, start_step + steps):
        x, y = data(step)
        with _TransferCounter() as counter:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(loss=loss)
        transfers.append(counter.calls)
    monitor.close()
    return transfers


def _meta_built_with_fc2_uninitialised() -> torch.nn.Module:
    """The pytorch/examples FSDP2 pattern: built on meta, ``to_empty``, a reset that misses a module. What the
    missed module's memory holds is arbitrary; here it is a known pattern of NaN and Inf among finite values."""
    with torch.device("meta"):
        model = MLP()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.fc1.reset_parameters()
    with torch.no_grad():
        model.fc2.weight.normal_()
        model.fc2.weight.view(-1)[::7] = float("nan")
        model.fc2.weight.view(-1)[3::11] = float("inf")
        model.fc2.bias.zero_()
        model.fc2.bias[1] = -float("inf")
    return model


@pytest.mark.parametrize("path", ["host", "device"])
def test_a_parameter_left_uninitialised_is_the_first_origin(tmp_path, monkeypatch, path):
    if path == "device":  # the accelerators' path (counted where the tensors are, copied without waiting)
        monkeypatch.setattr(param_check, "COUNTED_AT_ONCE", ())
    model = _meta_built_with_fc2_uninitialised()
    truth = {name: p.detach().double().numpy().copy() for name, p in model.named_parameters()}
    transfers = _train(model, tmp_path)
    assert all(calls == ["cpu"] for calls in transfers), transfers  # one transfer per collected step, step 0 too
    first = _events(tmp_path)[0]
    weight = truth["fc2.weight"]
    assert (first["step"], first["family"], first["name"], first["phase"]) == (0, "param", "fc2.weight", "forward")
    assert first["order"] < 0 and first["detector"] == "nonfinite"
    assert (first["metric"], first["value"]) == ("nans", float(np.isnan(weight).sum()))
    assert f"nans={int(np.isnan(weight).sum())}" in first["message"]
    assert "to_empty()" in first["message"] and "checkpoint saved after a non-finite step" in first["message"]
    assert math.isfinite(float(np.abs(truth["fc1.weight"]).max()))  # the module reset really is finite
    # later steps: the ordinary first origin (the parameters are checked once, as training begins)
    assert all(event["family"] != "param" for event in _events(tmp_path)[1:])


def test_resuming_from_a_checkpoint_saved_after_a_nan_step_names_its_parameter(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    state = model.state_dict()
    state["fc1.bias"][5] = float("nan")  # what a checkpoint saved after a non-finite update holds
    model.load_state_dict(state)
    _train(model, tmp_path, start_step=40, steps=2)
    first = _events(tmp_path)[0]
    assert (first["step"], first["family"], first["name"], first["value"]) == (40, "param", "fc1.bias", 1.0)


def test_finite_parameters_give_no_row_even_when_their_squares_overflow(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    with torch.no_grad():
        model.fc2.weight[0, 0] = 3e38  # finite: its square is not (the screen flags it, the count clears it)
    _train(model, tmp_path, steps=1)
    assert all(event["family"] != "param" for event in _events(tmp_path))
    healthy = MLP()
    _train(healthy, tmp_path / "healthy", steps=2)
    assert _events(tmp_path / "healthy") == []


def test_a_failing_check_changes_neither_training_nor_the_other_detection(tmp_path, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    reference = _meta_built_with_fc2_uninitialised()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for step in range(3):
        x, y = data(step)
        torch.nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    monkeypatch.setattr(param_check.ParameterCheck, "__init__", broken)
    model = _meta_built_with_fc2_uninitialised()
    _train(model, tmp_path)
    for param, expected in zip(model.parameters(), reference.parameters()):  # bit for bit, NaN where NaN
        torch.testing.assert_close(param, expected, rtol=0, atol=0, equal_nan=True)
    events = _events(tmp_path)
    assert events and events[0]["family"] == "actv"  # the detectors still run: the first module output instead
    assert "param_check" in caplog.text and "injected" in caplog.text


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")
def test_fsdp2_local_shards_are_checked(tmp_path):
    """pytorch/examples' FSDP2 example as published: ``fully_shard`` on the meta device, ``to_empty``, a root
    ``reset_parameters()`` that does not reach the blocks (a 1-rank gloo group here: DTensor parameters whose
    local shards are read, on the CPU without waiting for anything)."""
    from torch.distributed.fsdp import fully_shard

    with one_rank_gloo() as mesh:
        with torch.device("meta"):
            model = MLP()
        fully_shard(model.fc2, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        model.fc1.reset_parameters()
        with torch.no_grad():
            model.fc2.weight.to_local().normal_()
            model.fc2.weight.to_local().view(-1)[::5] = float("inf")
            model.fc2.bias.to_local().zero_()
        infs = int(np.isinf(model.fc2.weight.detach().full_tensor().double().numpy()).sum())
        transfers = _train(model, tmp_path, steps=2)
    assert all(calls == ["cpu"] for calls in transfers), transfers
    first = _events(tmp_path)[0]
    assert (first["family"], first["name"], first["metric"], first["value"]) == ("param", "fc2.weight", "infs", infs)
