"""Lifecycle, step control, targets, host transfers, failing outputs, struct, dynamic config."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from tests.models import TinyNet, batch, loss_fn
from tests.reference import read_family
from trainmon import TargetError, TrainerMonitor
from trainmon.errors import ConfigError


def _train(model, optimizer, monitor, steps, start=0):
    for step in range(start, start + steps):
        loss = loss_fn(model, *batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step(loss=loss)


def _setup(tmp_path, **config):
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    base = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"]}
    return model, optimizer, TrainerMonitor({**base, **config})


class _TransferCounter:
    """Counts host-synchronising tensor calls made from trainmon code on the training thread.

    ``numpy()`` of a CPU tensor is a zero-copy view (trainmon's CPU fast path for counts), not a
    transfer, so it is counted only for tensors on another device; everything else always counts.
    """

    METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._originals = {}

    def __enter__(self):
        main = threading.current_thread()
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original

            def wrapper(tensor, *args, _original=original, _name=name, **kwargs):
                view = _name == "numpy" and tensor.device.type == "cpu"
                if not view and threading.current_thread() is main and _from_trainmon():
                    self.calls.append(_name)
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)


def _from_trainmon() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("trainmon"):
            return True
        frame = frame.f_back
    return False


def test_one_host_transfer_per_collected_step_and_none_otherwise(tmp_path):
    model, optimizer, monitor = _setup(tmp_path, step_interval=2,
                                       activations={"enabled": True}, params={"enabled": True})
    monitor.attach(model, optimizer)
    per_step = []
    for step in range(4):
        with _TransferCounter() as counter:
            loss = loss_fn(model, *batch(step))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(loss=loss)
        per_step.append(counter.calls)
    monitor.close()
    # The one transfer is the `.cpu()` of the stacked statistics.
    assert per_step[0] == ["cpu"] and per_step[2] == ["cpu"], per_step
    assert per_step[1] == [] and per_step[3] == [], per_step


def test_step_control(tmp_path):
    model, optimizer, monitor = _setup(tmp_path, start_step=2, step_interval=3, collect_times=2)
    monitor.attach(model, optimizer)
    _train(model, optimizer, monitor, 12)
    monitor.close()
    steps = sorted(set(read_family(tmp_path / "run" / "rank0", "grad_reduced")["step"]))
    assert steps == [2, 5]


def test_uncollected_steps_leave_no_hooks_armed(tmp_path):
    model, optimizer, monitor = _setup(tmp_path, step_interval=10, activations={"enabled": True})
    monitor.attach(model, optimizer)
    assert len(model.layers[0].fc1._forward_hooks) == 1  # step 0 is collected
    _train(model, optimizer, monitor, 1)
    assert len(model.layers[0].fc1._forward_hooks) == 0
    assert not model.layers[0].fc1.weight._post_accumulate_grad_hooks
    monitor.close()


def test_ranks_naming_no_rank_of_the_job_fail_at_attach(tmp_path):
    """``ranks: [1]`` in a 1-rank job would silently write nothing: attach names the key instead."""
    model, optimizer, monitor = _setup(tmp_path, ranks=[1])
    with pytest.raises(ConfigError, match="ranks"):
        monitor.attach(model, optimizer)
    monitor.close()
    assert not (tmp_path / "run" / "rank0").exists()


def test_targets_glob_regex_and_errors(tmp_path):
    model, optimizer, monitor = _setup(tmp_path, targets={"modules": ["layers.*.fc1"], "params": ["re:^head\\."]},
                                       activations={"enabled": True, "metrics": ["norm"]})
    monitor.attach(model, optimizer)
    _train(model, optimizer, monitor, 1)
    monitor.close()
    rank_dir = tmp_path / "run" / "rank0"
    modules = {name.rsplit(".", 1)[0] for name in read_family(rank_dir, "actv")["name"]}
    assert modules == {"layers.0.fc1", "layers.1.fc1"}
    assert set(read_family(rank_dir, "grad_reduced")["name"]) == {"head.weight", "head.bias"}

    model, optimizer, monitor = _setup(tmp_path, targets={"modules": ["layers.0.fc3"]},
                                       activations={"enabled": True})
    with pytest.raises(TargetError, match=r"targets.modules\[0\].*close names: .*'layers.0.fc1'"):
        monitor.attach(model, optimizer)
    monitor.close()


def test_close_is_idempotent_and_works_after_an_exception(tmp_path):
    model, optimizer, monitor = _setup(tmp_path, activations={"enabled": True})
    with pytest.raises(RuntimeError, match="boom"), monitor:
        monitor.attach(model, optimizer)
        loss_fn(model, *batch(0)).backward()
        raise RuntimeError("boom")
    monitor.close()
    monitor.close()
    with pytest.raises(RuntimeError, match="closed"):
        monitor.attach(model, optimizer)


def test_the_optimizer_hook_ends_steps_without_monitor_step(tmp_path):
    model, optimizer, monitor = _setup(tmp_path)
    monitor.attach(model, optimizer)
    for step in range(3):
        loss_fn(model, *batch(step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    assert sorted(set(read_family(tmp_path / "run" / "rank0", "exp_avg")["step"])) == [0, 1, 2]


@pytest.mark.parametrize("loop", ["evaluate_then_step", "lbfgs_closure"])
def test_an_evaluation_before_monitor_step_ends_no_step(tmp_path, caplog, loop):
    """Loops that evaluate between the optimizer's step and ``monitor.step()`` (pytorch/examples'
    time_sequence_prediction: LBFGS with a closure, then a no_grad forward): one monitor step per optimizer step.
    Before, the evaluation's forward ended the first step early and every later step was numbered one too high."""
    torch.manual_seed(0)
    model = TinyNet()
    lbfgs = loop == "lbfgs_closure"
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3) if lbfgs else \
        torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
                              "weight_grads": {"enabled": True}})
    monitor.attach(model, optimizer)
    losses = []
    for step in range(4):
        def closure(step=step):
            optimizer.zero_grad()
            loss = loss_fn(model, *batch(step))
            loss.backward()
            return loss
        if lbfgs:
            loss = optimizer.step(closure)
        else:
            loss = closure()
            optimizer.step()
        losses.append(loss.item())
        with torch.no_grad():
            model(batch(100)[0])  # the evaluation
        monitor.step(loss=loss)
    monitor.close()
    scalars = read_family(tmp_path / "run" / "rank0", "scalars")
    logged = scalars[scalars["name"] == "loss"]
    assert list(logged["step"]) == [0, 1, 2, 3] and list(logged["value"]) == pytest.approx(losses, rel=1e-6)
    assert sorted(set(read_family(tmp_path / "run" / "rank0", "grad_reduced")["step"])) == [0, 1, 2, 3]
    assert "empty" not in caplog.text


def test_without_an_optimizer_the_gradients_are_measured_and_what_needs_it_is_named(tmp_path, caplog):
    """pytorch/examples' regression: a bare ``nn.Linear`` updated by hand (``param.data.add_(-0.1 * param.grad)``),
    ``attach(fc)``. The gradients are the loop's own (float64 numpy), and one warning names the families that
    are read at an optimizer's step, which are not written (before, they were left out silently)."""
    torch.manual_seed(0)
    fc = torch.nn.Linear(4, 1)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"], "step_interval": 1,
                              "params": {"enabled": True}})
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        monitor.attach(fc)
    truth = []
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        fc.zero_grad()
        loss = torch.nn.functional.smooth_l1_loss(fc(x), x.sum(1, keepdim=True))
        loss.backward()
        truth.append({name: np.linalg.norm(p.grad.double().numpy()) for name, p in fc.named_parameters()})
        for param in fc.parameters():
            param.data.add_(-0.1 * param.grad)
        monitor.step(loss=loss)
    monitor.close()
    warned = [r.getMessage() for r in caplog.records if "got no optimizer" in r.getMessage()]
    assert len(warned) == 1 and all(f in warned[0] for f in ("grad_reduced", "optimizer_states", "params")), warned
    rows = read_family(tmp_path / "run" / "rank0", "grad_unreduced")
    for step, norms in enumerate(truth):
        got = rows[rows["step"] == step].set_index("name")["norm"]
        assert got.to_dict() == pytest.approx(norms, rel=1e-6)
    assert not (tmp_path / "run" / "rank0" / "param.csv").exists()


def test_runs_started_in_the_same_second_never_share_a_default_run_dir(tmp_path, monkeypatch, caplog):
    """Independent processes started together (pytorch/examples' mnist_hogwild workers, a sweep) got the same
    timestamp as run name and appended to one run, their rows mixed. The default name is now claimed: the second
    run of the same second is ``{stamp}-1``. The same second is made certain here by fixing the clock's name."""
    monkeypatch.setattr("trainmon.runtime.setup.default_run_name", lambda: "20261129-000000")
    runs = []
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for seed in range(2):
            torch.manual_seed(seed)
            model = TinyNet()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            monitor = TrainerMonitor({"output_dir": str(tmp_path), "sinks": ["csv"]})
            monitor.attach(model, optimizer)
            _train(model, optimizer, monitor, 2)
            runs.append(monitor.run_dir)
            monitor.close()
    assert [run.name for run in runs] == ["20261129-000000", "20261129-000000-1"]
    assert "already holds a run" not in caplog.text
    for run in runs:
        assert list(read_family(run / "rank0", "scalars").query("name == 'loss'")["step"]) == [0, 1]


def test_unwritable_output_dir_warns_once_and_training_completes(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    model, optimizer, _ = _setup(tmp_path)
    monitor = TrainerMonitor({"output_dir": str(blocker / "out"), "activations": {"enabled": True}})
    monitor.attach(model, optimizer)
    _train(model, optimizer, monitor, 3)
    monitor.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "trainmon" in r.getMessage()]
    assert len(warnings) == 1 and "outputs are disabled" in warnings[0].getMessage()


def test_a_failing_sink_is_disabled_with_one_warning(tmp_path, caplog):
    model, optimizer, monitor = _setup(tmp_path)
    monitor.attach(model, optimizer)
    _train(model, optimizer, monitor, 1)
    monitor._session.writer.sinks[0].write = _raise_disk_full  # what a full disk looks like to a sink
    _train(model, optimizer, monitor, 3, start=1)
    monitor.close()
    warnings = [r for r in caplog.records if "disabled" in r.getMessage()]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()


def _raise_disk_full(record):
    raise OSError(28, "No space left on device")


def test_print_struct_writes_module_tree(tmp_path):
    model, optimizer, monitor = _setup(tmp_path, print_struct=True)
    monitor.attach(model, optimizer)
    _train(model, optimizer, monitor, 2)
    monitor.close()
    tree = json.loads((tmp_path / "run" / "rank0" / "module_struct.json").read_text())
    fc1 = tree["children"]["layers"]["children"]["0"]["children"]["fc1"]
    assert fc1["class"] == "Linear"
    assert fc1["tensors"]["output"] == {"shape": [4, 8, 32], "dtype": "float32"}


def test_dynamic_config_applies_from_next_step_and_ignores_broken_edits(tmp_path, caplog):
    path = tmp_path / "monitor.yaml"
    path.write_text(f"output_dir: {tmp_path}\nrun_name: dyn\nsinks: [csv]\ndynamic: {{watch: true, poll_seconds: 0}}\n")
    before = path.read_bytes()
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters())
    monitor = TrainerMonitor(path).attach(model, optimizer)
    _train(model, optimizer, monitor, 2)
    path.write_text(before.decode() + "activations: {enabled: true, metric: [norm]}\n")  # typo: ignored
    _train(model, optimizer, monitor, 1, start=2)
    path.write_text(before.decode() + "activations: {enabled: true, metrics: [norm]}\n")
    _train(model, optimizer, monitor, 1, start=3)  # step 3 picks the change up at its end
    _train(model, optimizer, monitor, 1, start=4)
    path.write_text(before.decode() + "enabled: false\n")
    _train(model, optimizer, monitor, 2, start=5)
    monitor.close()
    rank_dir = tmp_path / "dyn" / "rank0"
    assert sorted(set(read_family(rank_dir, "actv")["step"])) == [4, 5]
    assert max(read_family(rank_dir, "grad_reduced")["step"]) == 5
    assert any("activations.metric" in r.getMessage() for r in caplog.records)
    assert b"enabled: false" in path.read_bytes()  # the user's file is never rewritten by trainmon


def test_import_trainmon_pulls_in_no_framework():
    code = ("import sys, trainmon; bad = [m for m in ('torch', 'deepspeed', 'megatron', 'mindspore') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_failed_attach_leaves_no_hook_or_writer_thread(tmp_path):
    """A bad target found late in attach (the free benchmark's) must not leak what was set up before it."""
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters())
    before = {t.ident for t in threading.enumerate() if t.name == "trainmon-writer"}
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "activations": {"enabled": True},
                              "free_benchmark": {"enabled": True, "targets": ["no_such_layer"]}})
    with pytest.raises(TargetError, match="no_such_layer"):
        monitor.attach(model, optimizer)
    writers = [t for t in threading.enumerate() if t.name == "trainmon-writer" and t.ident not in before]
    assert not writers  # the hooks are checked by the no_leftovers fixture
    loss_fn(model, *batch(0)).backward()  # the model trains as if never attached
    optimizer.step()


def test_dynamic_watch_without_a_file_warns(tmp_path, caplog):
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "dynamic": {"watch": True}})
    monitor.attach(TinyNet())
    monitor.close()
    assert any("dynamic.watch needs a config file" in r.getMessage() for r in caplog.records)


def test_a_tensor_that_cannot_be_measured_is_skipped_with_one_warning(tmp_path, caplog):
    """A module returning a sparse tensor must not break the user's forward."""

    class WithSparse(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            return y, y.detach().to_sparse()

    model = torch.nn.Sequential()
    model.add_module("sp", WithSparse())
    optimizer = torch.optim.Adam(model.parameters())
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
                              # torch's own full backward hooks cannot wrap a sparse output: forward rows only
                              "activations": {"enabled": True, "backward": False}}).attach(model, optimizer)
    for _ in range(3):
        model(torch.randn(2, 4))[0].sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step()
    monitor.close()
    warned = [r.getMessage() for r in caplog.records if "cannot measure" in r.getMessage()]
    assert len(warned) == 1 and "actv/sp.output.1" in warned[0] and "sparse" in warned[0]
    rows = read_family(tmp_path / "run" / "rank0", "actv")
    assert "sp.output.0" in set(rows.name) and "sp.output.1" not in set(rows.name)


def test_step_scalars_accept_numbers_and_tensors_and_reject_others(tmp_path):
    model, optimizer, monitor = _setup(tmp_path)
    monitor.attach(model, optimizer)
    for loss in (1.5, torch.tensor(2.0), torch.tensor(3.0, dtype=torch.bfloat16)):
        loss_fn(model, *batch(0)).backward()
        optimizer.step()
        optimizer.zero_grad()
        assert float(monitor.step(loss=loss, tokens=7).scalars["loss"]) == float(loss)
    with pytest.raises(TypeError, match="step\\(\\): loss must be a number or a tensor, got str 'abc'"):
        monitor.step(loss="abc")
    monitor.close()


def test_run_dir_is_kept_after_close_and_logged_at_attach(tmp_path, caplog):
    model, optimizer, monitor = _setup(tmp_path)
    with caplog.at_level(logging.INFO, logger="trainmon"):
        monitor.attach(model, optimizer)
    _train(model, optimizer, monitor, 1)
    monitor.close()
    assert monitor.run_dir == tmp_path / "run" and monitor.rank_dir == tmp_path / "run" / "rank0"
    assert any(str(tmp_path / "run" / "rank0") in r.getMessage() for r in caplog.records)


def test_resume_keeps_the_first_run_json_and_appends_rows(tmp_path):
    model, optimizer, monitor = _setup(tmp_path, print_struct=True)
    monitor.attach(model, optimizer)
    _train(model, optimizer, monitor, 2)
    monitor.close()
    first = json.loads((tmp_path / "run" / "run.json").read_text())
    model2, optimizer2, monitor2 = _setup(tmp_path, print_struct=True)
    monitor2.attach(model2, optimizer2, start_step=2)
    _train(model2, optimizer2, monitor2, 2, start=2)
    monitor2.close()
    assert json.loads((tmp_path / "run" / "run.json").read_text()) == first
    assert (tmp_path / "run" / "run.resume1.json").exists()
    assert (tmp_path / "run" / "rank0" / "module_struct.resume1.json").exists()
    assert sorted(set(read_family(tmp_path / "run" / "rank0", "grad_reduced")["step"])) == [0, 1, 2, 3]
    assert (tmp_path / "run" / "rank0" / "writer_stats.json").exists()
