"""Fail-safe by construction, plain torch: trainmon's own exception raised in each kind of hook never reaches the
training loop, the training computes exactly what it computes without the monitor, one warning names the part
that was switched off, the failure is in the run's records, and the rest of the monitor goes on.

The other frameworks' cells of the matrix: tests/integration/test_fail_safe_frameworks.py (DeepSpeed, MindSpore)
and tests/distributed/test_fail_safe_distributed.py (DDP, FSDP2, Megatron-Core).
"""

from __future__ import annotations

import json
import logging

import pandas as pd
import pytest
import torch

from tests.faults import InjectedFault, patched
from tests.models import TinyNet, batch, loss_fn
from trainmon import TrainerMonitor
from trainmon.errors import AnomalyError

STEPS = 6
CONFIG = {"run_name": "run", "sinks": ["csv"], "activations": {"enabled": True},
          "params": {"enabled": True}}


def train(monitor: TrainerMonitor | None, steps: int = STEPS) -> tuple[dict[str, torch.Tensor], dict]:
    """A user's loop: Adam, a monitor (or none) attached; returns the parameters and the optimizer state."""
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    if monitor is not None:
        monitor.attach(model, optimizer)
    try:
        for step in range(steps):
            loss = loss_fn(model, *batch(step))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if monitor is not None:
                monitor.step(loss=loss)
    finally:
        if monitor is not None:
            monitor.close()
    return ({name: p.detach().clone() for name, p in model.named_parameters()},
            {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
             for k, s in optimizer.state_dict()["state"].items()})


def assert_bit_identical(got: tuple[dict, dict], expected: tuple[dict, dict]) -> None:
    for name, param in expected[0].items():
        assert torch.equal(got[0][name], param), f"{name} differs from the unmonitored run"
    for key, state in expected[1].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(got[1][key][name]), torch.as_tensor(value)), f"state {key}.{name}"


@pytest.fixture(scope="module")
def unmonitored() -> tuple[dict, dict]:
    return train(None)


KINDS = {  # fault -> (the families still written after it, the families that stop)
    "forward_hook": (["grad_reduced", "exp_avg"], ["actv"]),
    "backward_hook": (["grad_reduced", "exp_avg"], ["actv_grad"]),
    "grad_hook": (["actv"], ["grad_unreduced"]),
    "optimizer_pre_hook": (["actv"], ["grad_reduced"]),
    "optimizer_post_hook": (["actv"], ["exp_avg"]),
    "backward_end": (["actv"], ["grad_unreduced"]),
    "step_end": (["actv"], ["grad_reduced"]),
    "anomaly": (["actv", "grad_reduced", "exp_avg"], []),
    "step_model": ([], ["actv", "grad_reduced"]),
    "step_model_optimizer": ([], ["actv", "grad_reduced"]),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_failing_hook_never_reaches_training_and_changes_nothing(kind, tmp_path, monkeypatch, caplog, unmonitored):
    fault = patched(monkeypatch, kind, after=3)
    monitor = TrainerMonitor({**CONFIG, "output_dir": str(tmp_path)})
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        got = train(monitor)  # the injected exception must not come out of here
    assert_bit_identical(got, unmonitored)

    warnings = [r.getMessage() for r in caplog.records if "is off for the rest of this run" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"trainmon: {fault.part} failed (InjectedFault: injected fault"), warnings[0]

    rank_dir = tmp_path / "run" / "rank0"
    failures = json.loads((rank_dir / "failures.json").read_text())
    assert [part["part"] for part in failures["parts"]] == [fault.part]
    assert failures["parts"][0]["error"].startswith("InjectedFault")

    still, stopped = KINDS[kind]
    steps_of = {family: set(pd.read_csv(rank_dir / f"{family}.csv")["step"])
                if (rank_dir / f"{family}.csv").exists() else set() for family in still + stopped}
    for family in still:  # the rest of the monitor goes on, every step
        assert steps_of[family] == set(range(STEPS)), (family, steps_of[family])
    for family in stopped:  # the failed part writes nothing after its failure
        assert max(steps_of[family], default=-1) < STEPS - 1, (family, steps_of[family])
    if not kind.startswith("step_model"):  # the count is in the run's records from the failure on
        scalars = pd.read_csv(rank_dir / "scalars.csv")
        counts = scalars[scalars["name"] == "trainmon_failures"]
        assert len(counts) >= 1 and counts["value"].iloc[-1] >= 1


def test_the_users_own_exceptions_pass_through_unchanged(tmp_path):
    """A user's forward hook, a closure and a backward that raise: their exceptions reach the user as they are."""
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMonitor({**CONFIG, "output_dir": str(tmp_path)}).attach(model, optimizer)
    try:
        def user_hook(module, args, output):
            raise KeyError("the user's own")

        handle = model.layers[0].register_forward_hook(user_hook)
        with pytest.raises(KeyError, match="the user's own"):
            loss_fn(model, *batch(0))
        handle.remove()

        def closure():
            raise ValueError("closure of the user")

        with pytest.raises(ValueError, match="closure of the user"):
            optimizer.step(closure)
        loss = loss_fn(model, *batch(1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step(loss=loss)
    finally:
        monitor.close()
    assert not (tmp_path / "run" / "rank0" / "failures.json").exists()  # nothing of trainmon's failed


def test_the_raise_action_still_raises(tmp_path):
    """``anomaly.actions: [raise]`` is the user's choice: its AnomalyError is not swallowed by the guard."""
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {**CONFIG, "output_dir": str(tmp_path), "anomaly": {"actions": ["raise"]}}
    with TrainerMonitor(config).attach(model, optimizer) as monitor:
        loss = loss_fn(model, *batch(0)) * float("nan")
        loss.backward()
        optimizer.step()
        with pytest.raises(AnomalyError):
            monitor.step(loss=loss)


def test_injected_fault_is_an_exception_the_loop_would_see_without_the_guard(monkeypatch):
    """The injection itself works: called directly (no guard around it), the patched function raises."""
    patched(monkeypatch, "anomaly", after=1)
    from trainmon.anomaly.engine import AnomalyEngine

    with pytest.raises(InjectedFault):
        AnomalyEngine.process(None, None)
