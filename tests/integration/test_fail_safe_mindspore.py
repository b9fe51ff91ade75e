"""Fail-safe by construction under MindSpore (PyNative): trainmon's own exception injected into a cell forward
hook (activations), a parameter gradient hook, the optimizer cell's forward pre-hook and forward hook (weights),
by hand and inside ``Model.train`` with trainmon's callback: training completes, every parameter is bit-identical
to a run without trainmon, one warning names the part."""

from __future__ import annotations

import logging

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import Tensor, nn  # noqa: E402
from mindspore.train import Model  # noqa: E402

from tests.faults import patched  # noqa: E402
from tests.integration.test_mindspore_families import Mlp, _data  # noqa: E402
from trainmon import TrainerMonitor  # noqa: E402
from trainmon.integrations.mindspore import unwrap_training_cell  # noqa: E402
from trainmon.trainers.mindspore import TrainmonCallback  # noqa: E402

ms.set_context(mode=ms.PYNATIVE_MODE)
STEPS = 4
KINDS = ["mindspore_forward", "mindspore_grad_hook", "mindspore_optimizer", "mindspore_post_step"]


@pytest.fixture(autouse=True)
def no_leftovers():
    """The torch hook check does not apply to MindSpore cells (test_mindspore_families checks their hooks)."""
    yield


def _by_hand(config: dict | None) -> dict[str, np.ndarray]:
    ms.set_seed(0)
    net = Mlp()
    train = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.Adam(net.trainable_params(), 1e-2))
    monitor = TrainerMonitor(config).attach(*unwrap_training_cell(train)) if config else None
    for step in range(STEPS):
        loss = train(*(Tensor(a) for a in _data(step)))
        if monitor is not None:
            monitor.step(loss=loss)
    if monitor is not None:
        monitor.close()
    return {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}


def _model_train(config: dict | None) -> dict[str, np.ndarray]:
    ms.set_seed(0)
    net = Mlp()
    xs, ys = zip(*(_data(step) for step in range(STEPS)))
    data = ms.dataset.NumpySlicesDataset({"x": np.stack(xs), "y": np.stack(ys)}, shuffle=False)
    model = Model(net, nn.MSELoss(), nn.Adam(net.trainable_params(), 1e-2))
    model.train(1, data, callbacks=[TrainmonCallback(config)] if config else [], dataset_sink_mode=False)
    return {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}


@pytest.mark.parametrize("loop", [_by_hand, _model_train], ids=["by-hand", "Model.train"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_failing_hook_never_reaches_mindspore_training(tmp_path, monkeypatch, caplog, kind, loop):
    expected = loop(None)
    fault = patched(monkeypatch, kind, after=2)
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"], "activations": {"enabled": True}}
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        got = loop(config)
    for name, value in expected.items():
        assert np.array_equal(got[name], value), name
    warnings = [r.getMessage() for r in caplog.records if "is off for the rest of this run" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(f"trainmon: {fault.part} failed (InjectedFault"), warnings
