"""torch's "Full backward hook is firing ... no inputs require gradients" UserWarning: never for
trainmon's own hooks, still for a user's hook, and no warnings filter left behind."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from tests.reference import read_family
from trainmon import TrainerMonitor
from trainmon.collect.hooks import OUTPUT_ONLY_WARNING


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _train(tmp_path, model, steps=3, grad_acc=1, **activations):
    """A plain loop as users write it (data that does not require grad); returns the caught warnings."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
                              "activations": {"enabled": True, "metrics": ["norm"], **activations}})
    monitor.attach(model, optimizer, grad_acc_steps=grad_acc)
    filters_before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inner_filters = list(warnings.filters)
        for _step in range(steps):
            for _micro in range(grad_acc):
                x, y = torch.randn(4, 6), torch.randn(4, 3)
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                assert warnings.filters == inner_filters  # nothing of ours left in between
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(loss=loss)
    monitor.close()
    assert warnings.filters == filters_before
    return [w for w in caught if OUTPUT_ONLY_WARNING in str(w.message)]


def test_no_warning_for_trainmons_own_hooks_and_rows_still_written(tmp_path):
    model = _model()
    assert not _train(tmp_path, model, steps=3, grad_acc=2)
    rows = read_family(tmp_path / "run" / "rank0", "actv_grad")
    first = rows[rows["name"] == "0.output_grad"]
    assert sorted(zip(first["step"], first["micro_step"])) == [(s, m) for s in range(3) for m in range(2)]
    assert not (rows["name"] == "0.input_grad").any()  # the data has no gradient


def test_a_users_own_full_backward_hook_still_warns(tmp_path):
    model = _model()
    seen = []
    handle = model[0].register_full_backward_hook(lambda module, gi, go: seen.append(go[0].shape))
    try:
        caught = _train(tmp_path, model, steps=2)
    finally:
        handle.remove()
    assert len(caught) == 2 and len(seen) == 2  # one per backward, as torch alone would warn
    # and without trainmon, torch warns as before
    with warnings.catch_warnings(record=True) as plain:
        warnings.simplefilter("always")
        handle = model[0].register_full_backward_hook(lambda module, gi, go: None)
        model(torch.randn(2, 6)).sum().backward()
        handle.remove()
    assert [w for w in plain if OUTPUT_ONLY_WARNING in str(w.message)]


def test_a_users_hook_on_another_module_still_warns(tmp_path):
    """trainmon's filter is in place only while torch handles trainmon's module: a user's hook on a
    module whose inputs need no grad (a second data branch) still warns."""
    class TwoBranches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 3), nn.Linear(6, 3)

        def forward(self, x):
            return self.a(x) + self.b(x)

    torch.manual_seed(0)
    model = TwoBranches()
    handle = model.b.register_full_backward_hook(lambda module, gi, go: None)
    try:
        caught = _train(tmp_path, model, steps=2)
    finally:
        handle.remove()
    assert len(caught) == 2


def test_modules_whose_inputs_require_grad_are_untouched(tmp_path):
    """Hidden layers get inputs that require grad: torch never warns there, input_grad rows exist."""
    model = _model()
    assert not _train(tmp_path, model, steps=1)
    rows = read_family(tmp_path / "run" / "rank0", "actv_grad")
    assert {"2.input_grad", "2.output_grad", "1.input_grad"} <= set(rows["name"])
