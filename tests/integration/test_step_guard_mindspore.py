"""The step guard on MindSpore (PyNative, CPU): a poisoned step is not applied, bit for bit.

Each guarded run is compared with a reference written as a user would: the same loop (``optimizer(grads)`` by hand,
or ``Model.train``) that leaves the poisoned batch out. Every parameter of the network and every Parameter of the
optimizer (moments, ``beta1_power``/``beta2_power``, ``global_step``, the learning-rate schedule's state) must be
``np.array_equal``. The faults: a NaN in one element of one micro-batch's gradient (two micro-batches accumulated),
and the step's gradient times 10 (a spike the z-score catches). Checkpoints saved by ``ModelCheckpoint`` under
``Model.train`` get a health sidecar; a rollback names the last healthy one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="the MindSpore step guard needs mindspore (PyNative on the CPU)")
from mindspore import Tensor, nn  # noqa: E402
from mindspore.train import CheckpointConfig, Model, ModelCheckpoint  # noqa: E402

from tests.faults import patched  # noqa: E402
from tests.integration.test_mindspore_families import Mlp, _data, _hooks_left  # noqa: E402
from trainmon import TrainerMonitor, read_rollback  # noqa: E402
from trainmon.actions.rollback import RollbackExit  # noqa: E402
from trainmon.errors import AnomalyError, UnsupportedSetupError  # noqa: E402
from trainmon.integrations.mindspore.guard import MindSporeStepGuard  # noqa: E402
from trainmon.trainers.mindspore import TrainmonCallback, health_path, read_health  # noqa: E402

ms.set_context(mode=ms.PYNATIVE_MODE)
STEPS, BAD, BATCH = 8, 5, 5
GUARD = {"enabled": True, "z_threshold": 6.0, "warmup": 4, "window": 8}


def _optimizer(kind: str, params: list[Any]) -> nn.Optimizer:
    """The four optimizer types, each with what it keeps per step: a schedule (nn.Adam reads its learning rate
    from ``global_step``), a dynamic list (nn.Momentum), momentum buffers (nn.SGD)."""
    if kind == "adam":
        return nn.Adam(params, learning_rate=nn.ExponentialDecayLR(0.01, 0.9, 2), weight_decay=0.01)
    if kind == "adamw":
        return nn.AdamWeightDecay(params, learning_rate=0.01, weight_decay=0.01)
    if kind == "sgd":
        return nn.SGD(params, learning_rate=0.02, momentum=0.9)
    assert kind == "momentum"
    return nn.Momentum(params, learning_rate=[0.02 * 0.9 ** i for i in range(STEPS + 2)], momentum=0.9)


KINDS = ["adam", "adamw", "sgd", "momentum"]


def _state(net: nn.Cell, opt: nn.Optimizer) -> dict[str, np.ndarray]:
    """Every parameter of the network and every Parameter the optimizer keeps, copied to the host."""
    state = {f"net.{name}": p.asnumpy().copy() for name, p in net.parameters_and_names()}
    state.update({f"opt.{name}": p.asnumpy().copy() for name, p in opt.parameters_and_names()})
    return state


def assert_bit_identical(got: dict[str, np.ndarray], want: dict[str, np.ndarray], label: str) -> None:
    assert sorted(got) == sorted(want), label
    assert any(name.startswith("opt.global_step") for name in got)
    different = [name for name in want if not np.array_equal(got[name], want[name])]
    assert not different, (label, different)


def _config(tmp_path: Path, **guard: Any) -> dict[str, Any]:
    return {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
            "anomaly": {"guard": {**GUARD, **guard}, "actions": ["log", "jsonl"]}}


def _skipped(rank_dir: Path) -> list[int]:
    import pandas as pd

    scalars = pd.read_csv(rank_dir / "scalars.csv")
    rows = scalars[scalars.name == "step_skipped"]
    return sorted(int(step) for step in rows[rows.value > 0].step)


def _guard_events(rank_dir: Path) -> list[dict[str, Any]]:
    lines = (rank_dir / "anomalies.jsonl").read_text().splitlines() if (rank_dir / "anomalies.jsonl").exists() else []
    return [e for e in map(json.loads, lines) if e["detector"] == "step_guard"]


# ---------------------------------------------------------------------------------------------- a user's loop
def user_loop(kind: str, fault: str | None, monitor: TrainerMonitor | None = None, leave_out: int | None = None
              ) -> dict[str, np.ndarray]:
    """``optimizer(grads)`` by hand, two micro-batches accumulated per step; ``leave_out``: the reference skips that
    step's batch (no forward, no optimizer call)."""
    ms.set_seed(0)
    net = Mlp()
    opt = _optimizer(kind, net.trainable_params())
    loss_fn = nn.MSELoss()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    if monitor is not None:
        monitor.attach(net, opt)
    for step in range(STEPS):
        if step == leave_out:
            continue
        grads = None
        for micro in range(2):
            x, y = _data(2 * step + micro, n=BATCH)
            loss, micro_grads = grad_fn(Tensor(x), Tensor(y))
            if fault == "nan" and step == BAD and micro == 1:  # one element of one micro-batch's gradient
                poisoned = micro_grads[0].asnumpy().copy()
                poisoned.flat[3] = np.nan
                micro_grads = (Tensor(poisoned), *micro_grads[1:])
            grads = micro_grads if grads is None else tuple(a + b for a, b in zip(grads, micro_grads))
        assert grads is not None
        grads = tuple(g / 2 for g in grads)
        if fault == "spike" and step == BAD:
            grads = tuple(g * 10 for g in grads)
        opt(grads)
        if monitor is not None:
            monitor.step(loss=loss, batch=(2 * BATCH * step, 2 * BATCH * (step + 1)))
    if monitor is not None:
        monitor.close()
        assert not _hooks_left(net, opt) and "construct" not in opt.__dict__
    return _state(net, opt)


@pytest.mark.parametrize("fault", ["nan", "spike"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_poisoned_step_is_not_applied_in_a_users_loop(tmp_path: Path, kind: str, fault: str) -> None:
    got = user_loop(kind, fault, TrainerMonitor(_config(tmp_path)))
    want = user_loop(kind, None, leave_out=BAD)
    assert_bit_identical(got, want, f"{kind} {fault}")
    rank_dir = tmp_path / "run" / "rank0"
    assert _skipped(rank_dir) == [BAD]
    events = _guard_events(rank_dir)
    assert [(e["step"], e["detector"]) for e in events] == [(BAD, "step_guard")]
    assert ("(nonfinite)" if fault == "nan" else "(z_score)") in events[0]["message"]
    if fault == "nan":
        assert events[0]["name"] == "fc1.weight"  # the parameter whose gradient holds the NaN
    skip_list = [json.loads(line) for line in (rank_dir / "skip_list.jsonl").read_text().splitlines()]
    assert [(e["step"], e["batch"]) for e in skip_list if not e["applied"]] == [
        (BAD, {"samples": [[2 * BATCH * BAD, 2 * BATCH * (BAD + 1)]]})]


def test_a_skipped_step_writes_no_precursor_rows(tmp_path: Path) -> None:
    """The optimizer-state rows of a skipped step are the states it left alone; the precursor rows, which fold the
    step's gradient into the moments, are not written for it."""
    import pandas as pd

    config = {**_config(tmp_path), "optimizer_states": {"precursors": True}}
    got = user_loop("adam", "nan", TrainerMonitor(config))
    assert_bit_identical(got, user_loop("adam", None, leave_out=BAD), "precursors on")
    rank_dir = tmp_path / "run" / "rank0"
    assert sorted(set(pd.read_csv(rank_dir / "precursors.csv").step)) == [s for s in range(STEPS) if s != BAD]
    assert sorted(set(pd.read_csv(rank_dir / "exp_avg.csv").step)) == list(range(STEPS))


def test_skipped_steps_in_a_row_escalate(tmp_path: Path) -> None:
    """``escalate_after: 2``: the second NaN step in a row raises AnomalyError at the end of that step (the raise
    action of ``escalate``), after the guard kept both steps out of the weights."""
    ms.set_seed(0)
    net = Mlp()
    opt = _optimizer("adam", net.trainable_params())
    grad_fn = ms.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, opt.parameters)
    monitor = TrainerMonitor(_config(tmp_path, escalate_after=2)).attach(net, opt)
    before: dict[str, np.ndarray] = {}
    with pytest.raises(AnomalyError, match="2 steps in a row skipped by the step guard"):
        for step in range(STEPS):
            x, y = _data(step, n=BATCH)
            if step == BAD:
                x[0, 0] = np.nan
                before = _state(net, opt)
            loss, grads = grad_fn(Tensor(x), Tensor(y))
            opt(grads)
            monitor.step(loss=loss)
            if step == BAD:  # the weights are still finite: the next step's gradient is poisoned by its data only
                assert_bit_identical(_state(net, opt), before, "first skip")
                loss, grads = grad_fn(Tensor(np.full_like(x, np.nan)), Tensor(y))
                opt(grads)
                monitor.step(loss=loss)
    monitor.close()
    assert_bit_identical(_state(net, opt), before, "two skips")
    events = _guard_events(tmp_path / "run" / "rank0")
    assert [(e["step"], e["metric"]) for e in events] == [(BAD, "norm"), (BAD + 1, "norm"),
                                                          (BAD + 1, "skipped_in_a_row")]


def test_without_the_guard_the_poisoned_step_is_applied(tmp_path: Path) -> None:
    """The test's own control: the spike changes the result when nothing holds it back."""
    got = user_loop("adam", "spike")
    want = user_loop("adam", None, leave_out=BAD)
    assert not all(np.array_equal(got[name], want[name]) for name in want if name.startswith("net."))


def test_a_failing_guard_applies_the_step_as_without_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """trainmon's own exception inside the guard's decision (from its 2nd call): every step is applied as without
    the guard (the spike too), training goes on, one warning, the guard is off from then on."""
    fault = patched(monkeypatch, "mindspore_step_guard", after=2)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        got = user_loop("adam", "spike", TrainerMonitor(_config(tmp_path)))
    assert_bit_identical(got, user_loop("adam", "spike"), "failing guard")
    warnings = [r.getMessage() for r in caplog.records if "is off for the rest of this run" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(f"trainmon: {fault.part} failed"), warnings
    failures = json.loads((tmp_path / "run" / "rank0" / "failures.json").read_text())
    assert [part["part"] for part in failures["parts"]] == ["step_guard"]


@pytest.fixture(params=["host", "device"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The guard's two ways to measure: on the CPU the gradients' memory on the host (after one wait), elsewhere
    MindSpore ops on the device and one read of the ``[P]`` norms (forced here by saying the device is not a CPU)."""
    if request.param == "device":
        monkeypatch.setattr("trainmon.integrations.mindspore.guard.on_cpu", lambda: False)
    return str(request.param)


def test_the_norms_are_the_gradients_norms_with_one_host_read(tmp_path: Path, path: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Against float64 numpy; the optimizer's own ``loss_scale`` is divided out (its ``scale_grad`` does). The
    device path reads the host once per optimizer call (the ``[P]`` norms); the host path reads views of the
    gradients' host memory (the first waits for the queue)."""
    ms.set_seed(0)
    net = Mlp()
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9, loss_scale=8.0)
    config = TrainerMonitor(_config(tmp_path)).config.anomaly.guard
    guard = MindSporeStepGuard(config, opt, {}, _NoGuard(), lambda skipped: None)
    assert guard.host == (path == "host")
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(p.shape).astype(np.float32) * 8.0 for p in opt.parameters]
    grads = tuple(Tensor(a) for a in arrays)
    want = np.array([np.sqrt(np.sum(a.astype(np.float64) ** 2)) / 8.0 for a in arrays])
    got = guard.host_norms(grads).numpy() if path == "host" else guard.norms(grads)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    opt(grads)  # the first call compiles the optimizer's construct (MindSpore reads constants then)
    reads: list[int] = []
    monkeypatch.setattr(Tensor, "asnumpy", _counting(Tensor.asnumpy, reads))
    for step in range(3):
        before = len(reads)
        opt(grads)
        assert path == "host" or len(reads) - before == 1, step
    guard.close()
    assert "construct" not in opt.__dict__ and float(opt.global_step.asnumpy()[0]) == 4


@pytest.mark.parametrize("fault", ["nan", "spike"])
def test_the_device_path_skips_alike(tmp_path: Path, fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("trainmon.integrations.mindspore.guard.on_cpu", lambda: False)
    got = user_loop("adam", fault, TrainerMonitor(_config(tmp_path)))
    assert_bit_identical(got, user_loop("adam", None, leave_out=BAD), f"device path {fault}")
    assert _skipped(tmp_path / "run" / "rank0") == [BAD]


class _NoGuard:
    """A fail-safe guard that lets exceptions through (the test wants to see them)."""

    def off(self, part: str) -> bool:
        return False

    def run(self, part: str, fn: Any, *args: Any) -> Any:
        return fn(*args)


def _counting(method: Any, calls: list[int]) -> Any:
    def asnumpy(self: Tensor) -> Any:
        calls.append(1)
        return method(self)

    return asnumpy


def test_refusals_at_attach(tmp_path: Path) -> None:
    ms.set_seed(0)
    net = Mlp()
    with pytest.raises(UnsupportedSetupError, match="needs the optimizer"):
        TrainerMonitor(_config(tmp_path)).attach(net, None)
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        with pytest.raises(UnsupportedSetupError, match="PyNative"):
            TrainerMonitor(_config(tmp_path)).attach(net, opt)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert not _hooks_left(net, opt) and "construct" not in opt.__dict__
    manager = nn.DynamicLossScaleUpdateCell(loss_scale_value=2.0 ** 10, scale_factor=2, scale_window=100)
    train = nn.TrainOneStepWithLossScaleCell(nn.WithLossCell(net, nn.MSELoss()), opt, scale_sense=manager)
    callback = TrainmonCallback(_config(tmp_path))
    with pytest.raises(UnsupportedSetupError, match="dynamic loss scale"):
        Model(train).train(1, _dataset(None), callbacks=[callback], dataset_sink_mode=False)
    assert callback.monitor is None and not _hooks_left(net, opt) and "construct" not in opt.__dict__


# ---------------------------------------------------------------------------------------------- Model.train
def _dataset(fault: str | None, leave_out: int | None = None, steps: int = STEPS) -> ms.dataset.Dataset:
    """``steps`` batches of ``BATCH``; ``fault`` poisons batch ``BAD`` (0-based): a NaN in an input (its gradient is
    NaN), or targets times 10 (a gradient about 10 times the others); ``leave_out``: that batch is not there."""
    xs, ys = [], []
    for i in range(steps):
        x, y = _data(i, n=BATCH)
        if i == BAD and fault == "nan":
            x = x.copy()
            x[2, 1] = np.nan
        elif i == BAD and fault == "spike":
            y = y * 10
        if i != leave_out:
            xs.append(x)
            ys.append(y)
    return ms.dataset.NumpySlicesDataset({"x": np.concatenate(xs), "y": np.concatenate(ys)},
                                         shuffle=False).batch(BATCH)


def model_train(kind: str, dataset: ms.dataset.Dataset, callbacks: list[Any]) -> dict[str, np.ndarray]:
    ms.set_seed(0)
    net = Mlp()
    opt = _optimizer(kind, net.trainable_params())
    Model(net, nn.MSELoss(), opt).train(1, dataset, callbacks=callbacks, dataset_sink_mode=False)
    assert not _hooks_left(net, opt) and "construct" not in opt.__dict__
    return _state(net, opt)


@pytest.mark.parametrize(("kind", "fault"), [*[(kind, "nan") for kind in KINDS], ("adam", "spike")])
def test_a_poisoned_step_is_not_applied_under_model_train(tmp_path: Path, kind: str, fault: str) -> None:
    callback = TrainmonCallback(_config(tmp_path, z_threshold=6.0 if fault == "spike" else None))
    got = model_train(kind, _dataset(fault), [callback])
    want = model_train(kind, _dataset(fault, leave_out=BAD), [])
    assert_bit_identical(got, want, f"Model.train {kind} {fault}")
    rank_dir = tmp_path / "run" / "rank0"
    assert _skipped(rank_dir) == [BAD + 1]  # Model.train counts steps from 1
    skip_list = [json.loads(line) for line in (rank_dir / "skip_list.jsonl").read_text().splitlines()]
    guard_skips = [e for e in skip_list if not e["applied"]]
    assert [(e["step"], e["batch"]) for e in guard_skips] == [(BAD + 1, {"batches": [[0, BAD, BAD + 1]]})]


def test_model_train_gives_the_batches_and_the_samples(tmp_path: Path) -> None:
    """Two epochs: the batch position restarts each epoch; ``batch_ids`` adds the samples of the step's data."""
    seen: list[Any] = []

    def batch_ids(element: Any) -> list[int]:
        seen.append(element)
        return [len(seen)]  # the step's ordinal as a fake sample index

    callback = TrainmonCallback({**_config(tmp_path), "anomaly": {"guard": GUARD, "actions": ["log", "jsonl"],
                                                                  "rollback": {"detectors": ["nonfinite"]}}},
                                batch_ids=batch_ids)
    ms.set_seed(0)
    net = Mlp()
    opt = _optimizer("sgd", net.trainable_params())
    Model(net, nn.MSELoss(), opt).train(2, _dataset("nan", steps=BAD + 2), callbacks=[callback],
                                        dataset_sink_mode=False)
    assert len(seen) == 2 * (BAD + 2) and len(seen[0]) == 2  # (x, y) of each step
    skip_list = [json.loads(line) for line in (tmp_path / "run" / "rank0" / "skip_list.jsonl").read_text().splitlines()]
    steps = [(e["step"], e["batch"]) for e in skip_list if not e["applied"]]
    first, second = BAD + 1, BAD + 1 + BAD + 2
    assert steps == [(first, {"batches": [[0, BAD, BAD + 1]], "samples": [[first, first + 1]]}),
                     (second, {"batches": [[1, BAD, BAD + 1]], "samples": [[second, second + 1]]})]


# ---------------------------------------------------------------------------------------------- checkpoints
def _checkpointed(tmp_path: Path, config: dict[str, Any], trainmon_first: bool, every: int = 1
                  ) -> tuple[TrainmonCallback, Path, BaseException | None]:
    """Model.train of 6 batches (a NaN input in batch BAD) with a ModelCheckpoint saving every ``every`` steps,
    before or after the trainmon callback in the list."""
    ckpt_dir = tmp_path / "ckpt"
    saver = ModelCheckpoint(prefix="net", directory=str(ckpt_dir),
                            config=CheckpointConfig(save_checkpoint_steps=every, keep_checkpoint_max=50))
    callback = TrainmonCallback(config)
    ms.set_seed(0)
    net = Mlp()
    opt = _optimizer("sgd", net.trainable_params())
    raised = None
    try:
        Model(net, nn.MSELoss(), opt).train(1, _dataset("nan", steps=BAD + 2),
                                            callbacks=[callback, saver] if trainmon_first else [saver, callback],
                                            dataset_sink_mode=False)
    except RollbackExit as exc:
        raised = exc
    assert callback.monitor is None and not _hooks_left(net, opt)
    return callback, ckpt_dir, raised


def _tags(ckpt_dir: Path) -> dict[int, tuple[bool, int]]:
    """Model step (from the file name ``net-1_{step}.ckpt``) -> (healthy, the resume step) of each sidecar."""
    tags = {}
    for ckpt in sorted(ckpt_dir.glob("*.ckpt")):
        health = read_health(ckpt)
        assert health is not None, ckpt
        assert health["checkpoint"] == str(ckpt)
        assert health["monitor"] is None if health["monitor"] is None else health["monitor"]["step"] == health["step"]
        tags[int(ckpt.stem.split("_")[-1])] = (health["healthy"], health["step"])
    assert sorted(p.name for p in ckpt_dir.glob("*.json")) == sorted(health_path(c).name
                                                                     for c in ckpt_dir.glob("*.ckpt"))
    return tags


@pytest.mark.parametrize("trainmon_first", [True, False])
def test_checkpoints_are_tagged_healthy_until_an_applied_nan(tmp_path: Path, trainmon_first: bool) -> None:
    """Guard off: the NaN of step BAD + 1 is applied; the checkpoints from it on are unhealthy. The file saved by
    ModelCheckpoint's own end of training (steps 2, 4, then 7 at the end) is tagged too, in either order."""
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
              "anomaly": {"actions": ["log", "jsonl"], "rollback": {"detectors": ["nonfinite"]}}}
    _, ckpt_dir, raised = _checkpointed(tmp_path, config, trainmon_first, every=2)
    assert raised is None
    steps = BAD + 2
    assert _tags(ckpt_dir) == {2: (True, 3), 4: (True, 5), 6: (False, 7), steps: (False, steps + 1)}


def test_with_the_guard_every_checkpoint_is_healthy(tmp_path: Path) -> None:
    config = {**_config(tmp_path), "anomaly": {"guard": GUARD, "actions": ["log", "jsonl"],
                                               "rollback": {"detectors": ["nonfinite", "step_guard"]}}}
    _, ckpt_dir, raised = _checkpointed(tmp_path, config, trainmon_first=False)
    assert raised is None
    assert _tags(ckpt_dir) == {step: (True, step + 1) for step in range(1, BAD + 3)}


@pytest.mark.parametrize("trainmon_first", [True, False])
def test_a_rollback_names_the_last_healthy_checkpoint(tmp_path: Path, trainmon_first: bool) -> None:
    """The rollback action stops Model.train at the end of the NaN step; rollback.json names the checkpoint of the
    step before, and a callback given that checkpoint finds the rollback and the data to leave out."""
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
              "anomaly": {"actions": ["log", "jsonl", "rollback"], "rollback": {"detectors": ["nonfinite"]}}}
    _, ckpt_dir, raised = _checkpointed(tmp_path, config, trainmon_first)
    assert isinstance(raised, RollbackExit) and raised.code == 17
    bad_step = BAD + 1
    tags = _tags(ckpt_dir)
    assert all(tags[step] == (True, step + 1) for step in range(1, bad_step))
    # the file of the stopping step: saved before the callback's step end (then tagged unhealthy), or never
    assert tags.get(bad_step, (False, bad_step + 1)) == (False, bad_step + 1) and max(tags) <= bad_step
    assert (bad_step in tags) != trainmon_first
    rollback = read_rollback(tmp_path / "run")
    assert rollback is not None and rollback.resume_step == bad_step
    assert rollback.checkpoint == str(ckpt_dir / f"net-1_{bad_step - 1}.ckpt")
    assert rollback.skip.steps() == [bad_step] and rollback.skip.batches() == {0: [(BAD, BAD + 1)]}
    resumed = TrainmonCallback(config, checkpoint=rollback.checkpoint)
    ms.set_seed(0)
    net = Mlp()
    opt = _optimizer("sgd", net.trainable_params())
    Model(net, nn.MSELoss(), opt).train(1, _dataset(None, steps=2), callbacks=[resumed], dataset_sink_mode=False)
    assert resumed.rollback is not None and resumed.rollback.checkpoint == rollback.checkpoint
