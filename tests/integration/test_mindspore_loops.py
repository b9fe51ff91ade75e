"""The loops MindSpore users write: ``nn.TrainOneStepCell`` by hand and ``Model.train`` with the callback.

References are float64 numpy from what MindSpore really applied: with plain SGD (no momentum, no weight
decay) the gradient of a step is ``(p_before - p_after) / lr``, read from the parameters before and after
the step; the loss is the one the loop returns. Never trainmon's own values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import Tensor, nn  # noqa: E402
from mindspore.train import Callback, Model  # noqa: E402

from tests.integration import test_mindspore_families as families  # noqa: E402
from tests.integration.test_mindspore_families import Mlp, _data, _hooks_left  # noqa: E402
from tests.reference import METRICS, assert_close, np_stats, read_family  # noqa: E402
from trainmon import TrainerMonitor  # noqa: E402
from trainmon.errors import UnsupportedSetupError  # noqa: E402
from trainmon.integrations.mindspore import unwrap_training_cell  # noqa: E402
from trainmon.trainers.mindspore import TrainmonCallback  # noqa: E402

ms.set_context(mode=ms.PYNATIVE_MODE)
LR = 0.1
stats_path = families.stats_path  # both statistics paths: host (numpy, on the CPU) and device


@pytest.fixture(autouse=True)
def no_leftovers():
    """See test_mindspore_families.no_leftovers; the MindSpore hooks are checked in each test."""
    yield


def _params(net: nn.Cell) -> dict[str, np.ndarray]:
    return {name: p.asnumpy().astype(np.float64) for name, p in net.parameters_and_names()}


def _check_grads(rank_dir: Path, steps: dict[int, dict[str, np.ndarray]], label: str) -> None:
    """Every grad_unreduced and grad_reduced row of each step against the gradient SGD applied."""
    for family in ("grad_unreduced", "grad_reduced"):
        frame = read_family(rank_dir, family)
        assert sorted(set(frame.step)) == sorted(steps), (label, family)
        for step, grads in steps.items():
            rows = frame[frame.step == step]
            assert sorted(rows.name) == sorted(grads), (label, family, step)
            for _, row in rows.iterrows():
                reference = grads[row["name"]]
                # (p_before - p_after) / lr carries float32 rounding of p: about 1e-7 |p| / lr absolute
                assert_close(row, np_stats(reference), METRICS, rtol=1e-4, atol=1e-5,
                             label=f"{label} {family} {row['name']} step {step}")


def test_train_one_step_cell_by_hand(tmp_path: Path, stats_path: str) -> None:
    ms.set_seed(0)
    net = Mlp()
    opt = nn.SGD(net.trainable_params(), learning_rate=LR)
    train = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)
    with pytest.raises(UnsupportedSetupError, match="network inside"):  # the cell's forward is a whole step
        TrainerMonitor({"output_dir": str(tmp_path / "refused")}).attach(train)
    assert unwrap_training_cell(train) == (net, opt)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
                              "activations": {"enabled": True}})
    monitor.attach(*unwrap_training_cell(train))
    grads, losses = {}, {}
    for step in range(3):
        before = _params(net)
        loss = train(*(Tensor(a) for a in _data(step)))
        monitor.step(loss=loss)
        after = _params(net)
        grads[step] = {name: (before[name] - after[name]) / LR for name in before}
        losses[step] = float(loss.asnumpy())
    monitor.close()
    assert not _hooks_left(net, opt)
    rank_dir = tmp_path / "run" / "rank0"
    _check_grads(rank_dir, grads, "TrainOneStepCell")
    scalars = read_family(rank_dir, "scalars")
    for step, loss in losses.items():
        got = dict(zip(scalars[scalars.step == step].name, scalars[scalars.step == step].value))
        assert np.isclose(got["loss"], loss, rtol=1e-6), (step, got, loss)
        norm = np.sqrt(sum(np.sum(g ** 2) for g in grads[step].values()))
        assert np.isclose(got["grad_norm"], norm, rtol=1e-4), (step, got["grad_norm"], norm)
    actv = read_family(rank_dir, "actv")
    assert sorted(set(zip(actv.step, actv.micro_step))) == [(0, 0), (1, 0), (2, 0)]  # one forward per step


class _Snapshots(Callback):  # type: ignore[misc]
    """The parameters before and after each step and the loss the train network returned (a user callback)."""

    def __init__(self, net: nn.Cell) -> None:
        super().__init__()
        self.net = net
        self.before: dict[str, np.ndarray] = {}
        self.grads: dict[int, dict[str, np.ndarray]] = {}
        self.losses: dict[int, float] = {}

    def on_train_step_begin(self, run_context) -> None:
        self.before = _params(self.net)

    def on_train_step_end(self, run_context) -> None:
        args = run_context.original_args()
        after = _params(self.net)
        self.grads[args.cur_step_num] = {name: (self.before[name] - after[name]) / LR for name in after}
        self.losses[args.cur_step_num] = float(args.net_outputs.asnumpy())


def _dataset(batches: int = 3, batch: int = 5) -> ms.dataset.Dataset:
    xs, ys = zip(*(_data(i, n=batch) for i in range(batches)))
    data = {"x": np.concatenate(xs), "y": np.concatenate(ys)}
    return ms.dataset.NumpySlicesDataset(data, shuffle=False).batch(batch)


def test_model_train_with_the_callback(tmp_path: Path, stats_path: str) -> None:
    ms.set_seed(0)
    net = Mlp()
    opt = nn.SGD(net.trainable_params(), learning_rate=LR)
    model = Model(net, nn.MSELoss(), opt)
    snapshots = _Snapshots(net)
    callback = TrainmonCallback({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
                                 "activations": {"enabled": True}})
    model.train(2, _dataset(), callbacks=[snapshots, callback], dataset_sink_mode=False)
    assert callback.monitor is None and not _hooks_left(net, opt)  # closed at the end of training
    rank_dir = tmp_path / "run" / "rank0"
    assert sorted(snapshots.grads) == [1, 2, 3, 4, 5, 6]  # 2 epochs x 3 batches; Model counts from 1
    _check_grads(rank_dir, snapshots.grads, "Model.train")
    scalars = read_family(rank_dir, "scalars")
    losses = scalars[scalars.name == "loss"]
    assert losses.step.tolist() == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(losses.value.to_numpy(), [snapshots.losses[s] for s in losses.step], rtol=1e-6)
    actv = read_family(rank_dir, "actv")
    assert sorted(set(actv.step)) == [1, 2, 3, 4, 5, 6] and set(actv.micro_step) == {0}


def test_model_of_a_train_one_step_cell(tmp_path: Path) -> None:
    """``Model(TrainOneStepCell(...))``: the callback finds the network and optimizer inside; with
    ``initial_epoch`` too, the rows' steps are the Model's ``cur_step_num``."""
    ms.set_seed(0)
    net = Mlp()
    opt = nn.SGD(net.trainable_params(), learning_rate=LR)
    model = Model(nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt))
    snapshots = _Snapshots(net)
    callback = TrainmonCallback({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"]})
    model.train(3, _dataset(), callbacks=[snapshots, callback], dataset_sink_mode=False, initial_epoch=1)
    assert not _hooks_left(net, opt)
    rank_dir = tmp_path / "run" / "rank0"
    assert len(snapshots.grads) == 6  # epochs 2 and 3
    _check_grads(rank_dir, snapshots.grads, "Model(TrainOneStepCell)")


class _Boom(Callback):  # type: ignore[misc]
    def on_train_step_end(self, run_context) -> None:
        if run_context.original_args().cur_step_num == 2:
            raise RuntimeError("the user's callback failed")


def test_training_that_raises_closes_the_monitor(tmp_path: Path) -> None:
    """The user's exception passes through unchanged; the monitor is closed and leaves no hook behind."""
    ms.set_seed(0)
    net = Mlp()
    opt = nn.SGD(net.trainable_params(), learning_rate=LR)
    callback = TrainmonCallback({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
                                 "activations": {"enabled": True}})
    with pytest.raises(RuntimeError, match="the user's callback failed"):
        Model(net, nn.MSELoss(), opt).train(1, _dataset(), callbacks=[callback, _Boom()], dataset_sink_mode=False)
    assert callback.monitor is None and not _hooks_left(net, opt)
    assert sorted(set(read_family(tmp_path / "run" / "rank0", "grad_reduced").step)) == [1, 2]


def test_a_bad_config_fails_when_the_callback_is_built() -> None:
    with pytest.raises(ValueError, match="weight_grads"):
        TrainmonCallback({"weight_grads": {"metrics": ["norm", "nope"]}})


def test_graph_mode_is_refused_before_the_first_step(tmp_path: Path) -> None:
    """Cell hooks do not run in graph mode: the callback refuses at ``on_train_begin`` (nothing trained)."""
    ms.set_seed(0)
    net = Mlp()
    opt = nn.SGD(net.trainable_params(), learning_rate=LR)
    before = _params(net)
    callback = TrainmonCallback({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"]})
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        with pytest.raises(UnsupportedSetupError, match="PyNative"):
            Model(net, nn.MSELoss(), opt).train(1, _dataset(), callbacks=[callback], dataset_sink_mode=False)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert callback.monitor is None and not _hooks_left(net, opt)
    after = _params(net)
    assert all(np.array_equal(before[name], after[name]) for name in before)
