"""Optimizer-state rows of optimizers other than Adam, as pytorch/examples writes them (mnist: Adadelta with
StepLR; time_sequence_prediction: LBFGS with a closure), and RMSprop, SGD with Nesterov momentum, NAdam, RAdam.
Every row written is checked against the test's own float64 copy of ``optimizer.state[p]`` or of the real parameter
change; an optimizer whose states trainmon does not write says so once, and never gets rows that are Adam's
arithmetic on another optimizer's states. Training is bit-identical to a run without trainmon."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import pytest
import torch

from tests.loops.common import MLP, config, data, one_rank_gloo, rank_dir, rows, scalars
from tests.reference import np_stats
from trainmon import TrainerMonitor

STATES = {"enabled": True, "states": ["exp_avg", "exp_avg_sq", "update", "ratio", "momentum"]}
Make = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def _train(make: Make, monitor: TrainerMonitor | None, steps: int = 3, closure: bool = False) -> tuple:
    """mnist's loop (zero_grad, loss, backward, step, scheduler.step()), a closure for LBFGS. Returns the model,
    the losses and, per step, float64 copies of the parameters before and after and of each parameter's state."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = make(list(model.parameters()))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    if monitor is not None:
        monitor.attach(model, optimizer)
    losses, truth = [], []
    for step in range(steps):
        x, y = data(step)
        before = {n: p.detach().double().numpy().copy() for n, p in model.named_parameters()}
        lr = optimizer.param_groups[0]["lr"]

        def evaluate(x=x, y=y):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        if closure:
            loss = optimizer.step(evaluate)
        else:
            loss = evaluate()
            optimizer.step()
        states = {n: {k: v.double().numpy().copy() for k, v in optimizer.state[p].items()
                      if isinstance(v, torch.Tensor) and v.dim() > 0} for n, p in model.named_parameters()}
        after = {n: p.detach().double().numpy().copy() for n, p in model.named_parameters()}
        truth.append({"before": before, "after": after, "states": states, "lr": lr})
        losses.append(loss.item())
        scheduler.step()
    if monitor is not None:
        monitor.close()
    return model, losses, truth


def _run(tmp_path, make: Make, closure: bool = False, states: dict | None = None) -> list[dict]:
    plain, plain_losses, _ = _train(make, None, closure=closure)
    model, losses, truth = _train(make, TrainerMonitor(config(tmp_path, optimizer_states=states or STATES)),
                                  closure=closure)
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))
    learning_rates = scalars(tmp_path)["lr/group0"]
    assert list(learning_rates) == pytest.approx([t["lr"] for t in truth], rel=1e-7)  # StepLR's, step by step
    return truth


def _assert_state_rows(tmp_path, family: str, truth: list[dict], want: Callable[[dict, str], np.ndarray]) -> None:
    frame = rows(tmp_path, family)
    assert sorted(set(frame.step)) == list(range(len(truth)))
    for _, row in frame.iterrows():
        reference = np_stats(want(truth[int(row.step)], row["name"]))
        for metric in ("norm", "min", "max"):
            assert np.isclose(float(row[metric]), reference[metric], rtol=1e-5, atol=1e-9), \
                (family, int(row.step), row["name"], metric, float(row[metric]), reference[metric])


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.9),
], ids=["sgd-nesterov", "rmsprop-momentum"])
def test_momentum_buffers_are_the_optimizers_own(tmp_path, caplog, make):
    """With the default ``states`` (which name ``momentum`` since SGD users expect it: before, the default wrote
    nothing for SGD and warned)."""
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        truth = _run(tmp_path, make, states={"enabled": True})
    assert not [r.getMessage() for r in caplog.records if "keeps none of" in r.getMessage()]
    _assert_state_rows(tmp_path, "momentum", truth, lambda t, name: t["states"][name]["momentum_buffer"])
    assert not any((rank_dir(tmp_path) / f"{family}.csv").exists() for family in ("exp_avg", "update", "ratio"))


def test_adam_update_is_the_real_parameter_change(tmp_path):
    """amsgrad: ``update`` is ``m_hat / (sqrt(max v_hat) + eps)``, the step the parameter really took over ``-lr``."""
    truth = _run(tmp_path, lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True))
    _assert_state_rows(tmp_path, "update", truth, lambda t, name: (t["before"][name] - t["after"][name]) / t["lr"])
    for family in ("exp_avg", "exp_avg_sq"):
        _assert_state_rows(tmp_path, family, truth, lambda t, name, family=family: t["states"][name][family])


@pytest.mark.parametrize("make", [lambda p: torch.optim.NAdam(p, lr=1e-2), lambda p: torch.optim.RAdam(p, lr=1e-2)],
                         ids=["nadam", "radam"])
def test_adam_like_states_with_another_update_get_no_adam_update(tmp_path, caplog, make):
    """NAdam and RAdam keep ``exp_avg`` and ``exp_avg_sq`` but do not step by Adam's ``m_hat / (sqrt(v_hat) + eps)``:
    before, their ``update`` and ``ratio`` rows were Adam's arithmetic on their moments, up to 36x the real change.
    Now the moments are written (the optimizer's own) and the update is not, with one warning."""
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        truth = _run(tmp_path, make)
    for family in ("exp_avg", "exp_avg_sq"):
        _assert_state_rows(tmp_path, family, truth, lambda t, name, family=family: t["states"][name][family])
    assert not any((rank_dir(tmp_path) / f"{family}.csv").exists() for family in ("update", "ratio"))
    warned = [r.getMessage() for r in caplog.records if "Adam's" in r.getMessage()]
    assert len(warned) == 1 and "update" in warned[0] and type(make([torch.nn.Parameter(torch.ones(1))])).__name__ \
        in warned[0], warned


@pytest.mark.parametrize("make,closure,keys", [
    (lambda p: torch.optim.Adadelta(p, lr=1.0), False, ["acc_delta", "square_avg"]),  # pytorch/examples' mnist
    (lambda p: torch.optim.Adagrad(p, lr=0.1), False, ["sum"]),
    (lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=3), True, ["d", "old_dirs"]),  # time_sequence_prediction
], ids=["adadelta-steplr", "adagrad", "lbfgs-closure"])
def test_optimizers_without_the_states_asked_for_say_so_once(tmp_path, caplog, make, closure, keys):
    """Their states are none of exp_avg, exp_avg_sq, momentum_buffer: no optimizer-state rows (before: none either,
    without a word), one warning naming the optimizer and the states it keeps; gradients and lr are still written."""
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        _run(tmp_path, make, closure=closure)
    families = {path.stem for path in rank_dir(tmp_path).glob("*.csv")}
    assert {"grad_reduced", "grad_unreduced"} <= families
    assert not families & {"exp_avg", "exp_avg_sq", "momentum", "update", "ratio"}
    warned = [r.getMessage() for r in caplog.records if "keeps none of" in r.getMessage()]
    assert len(warned) == 1 and all(key in warned[0] for key in keys), warned


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")
def test_nadam_under_fsdp2_gets_no_adam_update(tmp_path, caplog):
    """The same under FSDP2 (``fully_shard`` on a 1-rank gloo group): the moments are written, from the shards the
    optimizer holds; no ``update``/``ratio`` rows, one warning."""
    from torch.distributed.fsdp import fully_shard

    with one_rank_gloo() as mesh:
        torch.manual_seed(0)
        model = MLP()
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.NAdam(model.parameters(), lr=1e-2)
        with caplog.at_level(logging.WARNING, logger="trainmon"):
            monitor = TrainerMonitor(config(tmp_path, optimizer_states=STATES)).attach(model, optimizer)
        moments = []
        for step in range(2):
            x, y = data(step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            moments.append({n: optimizer.state[p]["exp_avg"].full_tensor().double().numpy()
                            for n, p in model.named_parameters()})
            monitor.step()
        monitor.close()
    _assert_state_rows(tmp_path, "exp_avg", [{"states": {n: {"exp_avg": m} for n, m in step.items()}}
                                             for step in moments], lambda t, name: t["states"][name]["exp_avg"])
    assert not any((rank_dir(tmp_path) / f"{family}.csv").exists() for family in ("update", "ratio"))
    assert len([r for r in caplog.records if "Adam's" in r.getMessage()]) == 1
