"""The step guard (``anomaly.guard``): a poisoned step is not applied.

The truth is a reference run written as a user would, that skips the poisoned batch altogether (no forward,
backward or optimizer step for it; the LR scheduler still steps, as it does on a step the guard skips): after the
run, every parameter and every optimizer-state tensor of the guarded run equals it bit for bit (``torch.equal``).
Host synchronisations are counted by the counter of tests/integration/test_torch_lifecycle.py.
"""

from __future__ import annotations

import importlib.util
import json
import logging

import pandas as pd
import pytest
import torch

from tests.faults import patched
from tests.integration.test_torch_lifecycle import _TransferCounter
from tests.models import TinyNet, batch, loss_fn
from trainmon import TrainerMonitor
from trainmon.errors import AnomalyError, UnsupportedSetupError

STEPS = 9
MICRO = 2
GUARD = {"enabled": True, "window": 8, "warmup": 4}
OPTIMIZERS = {
    "adam_fused": lambda params: torch.optim.Adam(params, lr=1e-2, fused=True),
    "adamw_foreach": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),
    "sgd_momentum_fused": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False),
}


def _nan_in_one_entry(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad[0, 0] = float("nan")
    return grad


def train(kind: str, *, poison: str = "", bad: int = 6, skip: int | None = None, monitor: TrainerMonitor | None = None,
          steps: int = STEPS) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A user's loop: two micro-batches per step, an LR scheduler made before attach.

    ``poison``: at step ``bad``, ``nan`` puts a NaN in ``layers.1.fc2.weight``'s gradient of the second micro-batch;
    ``spike`` multiplies both micro-batches' loss by 10, ``layer`` only ``layers.0.norm.bias``'s gradient by 10.
    ``skip``: the reference leaves that step's batch out (no forward, backward or step) and steps the scheduler only.
    """
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = OPTIMIZERS[kind](model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    if monitor is not None:
        monitor.attach(model, optimizer, grad_acc_steps=MICRO)
    try:
        for step in range(steps):
            loss = None
            if step != skip:
                for micro in range(MICRO):
                    loss = loss_fn(model, *batch(MICRO * step + micro))
                    if poison == "spike" and step == bad:
                        loss = loss * 10
                    handle = None
                    if poison == "nan" and step == bad and micro == 1:
                        handle = model.layers[1].fc2.weight.register_hook(_nan_in_one_entry)
                    if poison == "layer" and step == bad:
                        handle = model.layers[0].norm.bias.register_hook(lambda grad: grad * 10)
                    (loss / MICRO).backward()
                    if handle is not None:
                        handle.remove()
                optimizer.step()
                optimizer.zero_grad()
            scheduler.step()
            if monitor is not None:
                monitor.step(loss=loss)
    finally:
        if monitor is not None:
            monitor.close()
    return model, optimizer


def assert_bit_identical(got: tuple[torch.nn.Module, torch.optim.Optimizer],
                         expected: tuple[torch.nn.Module, torch.optim.Optimizer]) -> None:
    for (name, param), reference in zip(got[0].named_parameters(), expected[0].parameters()):
        assert torch.equal(param, reference), f"parameter {name} differs from the run that skipped the batch"
    state, reference_state = got[1].state_dict(), expected[1].state_dict()
    assert state["state"].keys() == reference_state["state"].keys()
    for index, values in reference_state["state"].items():
        assert values.keys() == state["state"][index].keys()
        for key, value in values.items():
            assert torch.equal(torch.as_tensor(state["state"][index][key]), torch.as_tensor(value)), (index, key)
    assert [g["lr"] for g in state["param_groups"]] == [g["lr"] for g in reference_state["param_groups"]]


def _monitor(tmp_path, guard=GUARD, **config) -> TrainerMonitor:
    return TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
                           "anomaly": {"guard": guard}, **config})


def _skipped_steps(rank_dir) -> list[int]:
    scalars = pd.read_csv(rank_dir / "scalars.csv")
    skipped = scalars[scalars["name"] == "step_skipped"]
    assert list(skipped["step"]) == list(range(len(skipped)))  # every step, collected or not
    return list(skipped[skipped["value"] == 1.0]["step"])


def _guard_events(rank_dir) -> list[dict]:
    path = rank_dir / "anomalies.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [event for event in map(json.loads, lines) if event["detector"] == "step_guard"]


CASES = [  # optimizer, poison, poisoned step, step_interval
    ("adam_fused", "nan", 6, 4),
    ("adam_fused", "spike", 6, 1),
    ("adam_fused", "nan", 0, 1),  # the first step: the fused kernel made the (zero) state, then skipped
    ("adamw_foreach", "nan", 6, 1),
    ("adamw_foreach", "spike", 5, 4),
    ("sgd_momentum_fused", "spike", 6, 4),
    ("sgd_momentum_fused", "nan", 0, 4),  # decided on the host: no momentum buffer yet
    ("sgd_momentum", "nan", 6, 1),
]


@pytest.mark.filterwarnings("ignore:Detected call of .lr_scheduler.step")  # a skipped first step, as the user's
@pytest.mark.parametrize(("kind", "poison", "bad", "interval"), CASES, ids=[f"{c[0]}-{c[1]}-step{c[2]}" for c in CASES])
def test_a_poisoned_step_leaves_parameters_and_state_as_a_run_without_its_batch(tmp_path, kind, poison, bad,
                                                                                interval):
    guarded = train(kind, poison=poison, bad=bad, monitor=_monitor(tmp_path, step_interval=interval))
    assert_bit_identical(guarded, train(kind, skip=bad))
    rank_dir = tmp_path / "run" / "rank0"
    assert _skipped_steps(rank_dir) == [bad]
    (event,) = _guard_events(rank_dir)
    assert event["step"] == bad and event["family"] == "grad_reduced" and event["metric"] == "norm"
    if poison == "nan":
        assert event["name"] == "layers.1.fc2.weight" and event["value"] == "nan"
        assert "(nonfinite)" in event["message"]
    else:
        assert "(z_score)" in event["message"]
    if bad % interval == 0:  # a collected step: the rows of the gradients it did not apply, on either path
        reduced = pd.read_csv(rank_dir / "grad_reduced.csv")
        at = reduced[reduced["step"] == bad].set_index("name")
        assert len(at) == len(list(guarded[0].parameters()))
        assert (at.loc["layers.1.fc2.weight", "nans"] == 1) == (poison == "nan")


def test_without_the_guard_the_poison_reaches_the_weights(tmp_path):
    """The cases above are not trivially true: unguarded, the poisoned step changes the outcome."""
    model, _ = train("adam_fused", poison="nan")
    assert not all(torch.isfinite(p).all() for p in model.parameters())
    model, _ = train("adam_fused", poison="spike")
    reference, _ = train("adam_fused", skip=6)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


@pytest.mark.parametrize(("rule", "poison", "expected"), [
    ({"max_grad_norm": 3.0, "z_threshold": None}, "spike", "(max_grad_norm)"),
    ({"per_parameter": True}, "layer", "(parameter_z_score): the gradient norm of layers.0.norm.bias"),
])
def test_the_other_rules(tmp_path, rule, poison, expected):
    guarded = train("adamw_foreach", poison=poison, monitor=_monitor(tmp_path, {**GUARD, **rule}))
    assert_bit_identical(guarded, train("adamw_foreach", skip=6))
    (event,) = _guard_events(tmp_path / "run" / "rank0")
    assert expected in event["message"]


def test_one_layers_spike_is_left_to_the_global_rule_unless_per_parameter(tmp_path):
    """The same one-layer spike, without ``per_parameter``: the global norm hardly moves; the step is applied."""
    train("adamw_foreach", poison="layer", monitor=_monitor(tmp_path))
    assert _skipped_steps(tmp_path / "run" / "rank0") == []


def _syncs_per_step(tmp_path, kind: str, guard: dict | None) -> list[list[str]]:
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = OPTIMIZERS[kind](model.parameters())
    config = {"output_dir": str(tmp_path), "run_name": kind + str(bool(guard)), "sinks": ["csv"],
              "step_interval": 4, "anomaly": {"guard": guard or {"enabled": False}}}
    monitor = TrainerMonitor(config).attach(model, optimizer)
    calls = []
    for step in range(6):
        with _TransferCounter() as counter:
            loss = loss_fn(model, *batch(step))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(loss=loss)
        calls.append(counter.calls)
    monitor.close()
    return calls


def test_fused_optimizers_decide_without_a_host_synchronisation(tmp_path):
    """Adam(fused=True): the verdict goes to the kernel as ``found_inf``; nothing more is read on the host."""
    unguarded = _syncs_per_step(tmp_path, "adam_fused", None)
    assert unguarded == [["cpu"], [], [], [], ["cpu"], []]  # the one transfer of each collected step
    assert _syncs_per_step(tmp_path, "adam_fused", GUARD) == unguarded
    # an SGD with momentum once its buffers exist (its first step is decided on the host)
    assert _syncs_per_step(tmp_path, "sgd_momentum_fused", GUARD)[1:] == unguarded[1:]


def test_other_optimizers_read_the_verdict_once_per_step(tmp_path):
    """(An optimizer whose own step reads nothing on the host: the counter counts every call under trainmon's frames,
    and the optimizer's step runs inside the guard's wrapper.)"""
    unguarded = _syncs_per_step(tmp_path, "sgd_momentum", None)
    guarded = _syncs_per_step(tmp_path, "sgd_momentum", GUARD)
    assert guarded == [["tolist", *calls] for calls in unguarded]


def test_skips_in_a_row_escalate_to_the_configured_actions(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    monitor = _monitor(tmp_path, {**GUARD, "escalate_after": 2}, step_interval=3).attach(model, optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(AnomalyError, match="2 steps in a row skipped by the step guard"):
        for step in range(4):
            loss = loss_fn(model, *batch(step)) * float("nan")
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(loss=loss)
    assert step == 1  # raised at the end of the second skipped step
    monitor.close()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    events = _guard_events(tmp_path / "run" / "rank0")
    assert [(e["step"], e["metric"]) for e in events] == [(0, "norm"), (1, "norm"), (1, "skipped_in_a_row")]


def test_a_failing_guard_applies_the_step_as_without_it(tmp_path, monkeypatch, caplog):
    """trainmon's guard code raising: training completes as an unguarded run (the spike applied), one warning."""
    fault = patched(monkeypatch, "step_guard", after=2)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        got = train("adam_fused", poison="spike", monitor=_monitor(tmp_path))
    assert_bit_identical(got, train("adam_fused", poison="spike"))
    warnings = [r.getMessage() for r in caplog.records if "is off for the rest of this run" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(f"trainmon: {fault.part} failed"), warnings
    failures = json.loads((tmp_path / "run" / "rank0" / "failures.json").read_text())
    assert [part["part"] for part in failures["parts"]] == ["step_guard"]


def test_a_closure_runs_once_before_the_decision_and_the_schedulers_see_the_wrapper(tmp_path):
    """LBFGS-style ``step(closure)`` (Lightning's way): the guard runs the closure, then skips or hands the optimizer
    its result; a scheduler made after attach can wrap the guarded step."""
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = _monitor(tmp_path).attach(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)  # after attach: wraps the guard's step
    calls = []
    for step in range(3):
        def closure(step=step):
            calls.append(step)
            optimizer.zero_grad()
            loss = loss_fn(model, *batch(step)) * (float("nan") if step == 1 else 1.0)
            loss.backward()
            return loss

        before = [p.detach().clone() for p in model.parameters()]
        loss = optimizer.step(closure)
        scheduler.step()
        monitor.step(loss=loss)
        changed = not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert changed == (step != 1), step
    monitor.close()
    assert calls == [0, 1, 2]  # each closure ran once
    assert _skipped_steps(tmp_path / "run" / "rank0") == [1]
    # after close the scheduler's wrapper stays on top of the guard's, which passes every step through
    assert optimizer.step._wrapped_by_lr_sched
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step(lambda: loss_fn(model, *batch(0)).mul(float("nan")).backward())
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_close_removes_the_wrapper(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), fused=True)
    monitor = _monitor(tmp_path).attach(model, optimizer)
    assert "step" in optimizer.__dict__
    monitor.close()
    assert "step" not in optimizer.__dict__ and not optimizer._optimizer_step_pre_hooks


def test_set_ups_it_cannot_guard_are_refused_at_attach(tmp_path):
    """Refused before the collectors are built (framework detection reads the type's module).
    DeepSpeed's and Megatron-Core's refusals (fp16, offload, a loss scaler, ...) are tested with real objects in
    test_step_guard_deepspeed.py and test_step_guard_megatron.py."""
    if importlib.util.find_spec("mindspore") is not None:  # MindSpore's own refusals: test_step_guard_mindspore.py
        fake = type("Model", (torch.nn.Module,), {"__module__": "mindspore.fake"})
        with pytest.raises(UnsupportedSetupError, match="with this mindspore set-up: the step guard needs the opt"):
            _monitor(tmp_path).attach(fake(), None)
    with pytest.raises(UnsupportedSetupError, match="needs the optimizer"):
        _monitor(tmp_path).attach(TinyNet(), None)
    accelerated = type("AcceleratedOptimizer", (), {"__module__": "accelerate.optimizer", "scaler": object(),
                                                    "optimizer": torch.optim.SGD(TinyNet().parameters(), lr=0.1)})
    with pytest.raises(UnsupportedSetupError, match="accelerate's GradScaler"):
        _monitor(tmp_path).attach(TinyNet(), accelerated())
    assert not list((tmp_path / "run").glob("rank0/*"))


@pytest.mark.parametrize("kind", ["adam_fused", "adamw_foreach"])
def test_under_a_grad_scaler_overflow_is_the_scalers_and_a_spike_the_guards(tmp_path, kind):
    """With a GradScaler (the fused path gets its ``found_inf`` and ``grad_scale``): the overflow step the scaler
    skips (5) is not the guard's skip (no event, not in its streak), the spike right after it (6) is; the norms the
    guard judges are unscaled (``max_grad_norm: 3`` fires at the spike only, not at every step's norm x 1024)."""

    def run(guarded: bool):
        torch.manual_seed(0)
        model = TinyNet()
        optimizer = OPTIMIZERS[kind](model.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        monitor = _monitor(tmp_path, {**GUARD, "escalate_after": 2, "max_grad_norm": 3.0}).attach(
            model, optimizer, scaler=scaler) \
            if guarded else None
        for step in range(STEPS):
            if not guarded and step == 6:
                continue  # the reference leaves the spiked batch out
            loss = loss_fn(model, *batch(step)) * (10.0 if step == 6 else float("inf") if step == 5 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if monitor is not None:
                monitor.step(loss=loss)
        if monitor is not None:
            monitor.close()
        return model, optimizer, scaler.get_scale()

    *guarded, scale = run(True)
    *reference, reference_scale = run(False)
    assert scale == reference_scale == 2.0 ** 9  # the overflow halved it once
    assert_bit_identical(guarded, reference)
    rank_dir = tmp_path / "run" / "rank0"
    assert _skipped_steps(rank_dir) == [5, 6]
    events = _guard_events(rank_dir)
    assert [(e["step"], e["metric"]) for e in events] == [(6, "norm")]  # no escalation: step 5 was the scaler's
    assert "(max_grad_norm)" in events[0]["message"]
