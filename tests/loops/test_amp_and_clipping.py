"""AMP GradScaler and gradient clipping, written the way the torch AMP recipe writes them.

``scaler.scale(loss).backward(); scaler.unscale_(opt); clip_grad_norm_(...); scaler.step(opt);
scaler.update()``. The references: the test's own copies of ``p.grad`` right after the backward
(divided by the scale), after clipping inside the optimizer's step (what it steps with), the norm
``clip_grad_norm_`` returned, and ``scaler.get_scale()``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.integration.test_torch_lifecycle import _TransferCounter
from tests.loops.common import MLP, assert_rows_match, config, data, global_norm, grads64, rank_dir, rows, scalars
from trainmon import TrainerMonitor

OVERFLOW_STEP = 3
STEPS = 6


def _fp16_reason() -> str | None:
    try:
        if torch.ops.mkldnn._is_mkldnn_fp16_supported():
            return None
    except (AttributeError, RuntimeError):
        pass
    return "this CPU has no fp16 in oneDNN (torch.ops.mkldnn._is_mkldnn_fp16_supported() is False)"


def _amp_run(tmp_path, *, user_steps: bool, clip: float | None, pass_scaler: bool = True,
             autocast: torch.dtype | None = None):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)
    cfg = config(tmp_path, params={"enabled": True},
                 anomaly={"detectors": [{"type": "nonfinite"}], "actions": ["jsonl"]})
    monitor = TrainerMonitor(cfg).attach(model, optimizer, scaler=scaler if pass_scaler else None)
    ref = {"unscaled": {}, "used": {}, "norm": {}, "scale": {}, "param": {}}

    def capture_used(opt, args, kwargs):  # registered after trainmon's: the gradients the step uses
        ref["used"][step] = grads64(model)
        ref["param"][step] = {n: p.detach().double().numpy().copy() for n, p in model.named_parameters()}

    handle = optimizer.register_step_pre_hook(capture_used)
    transfers = []
    for step in range(STEPS):
        with _TransferCounter() as counter:
            x, y = data(step)
            if autocast is None:
                out = model(x)
            else:
                with torch.autocast("cpu", dtype=autocast):
                    out = model(x).float()
            if step == OVERFLOW_STEP:  # what fp16 does when the scale is too large: an Inf in the backward
                out.register_hook(lambda g: g * 1e38)
            loss = torch.nn.functional.mse_loss(out, y)
            scaler.scale(loss).backward()
            ref["scale"][step] = scaler.get_scale()
            ref["unscaled"][step] = grads64(model, divide=ref["scale"][step])
            scaler.unscale_(optimizer)
            if clip is not None:
                ref["norm"][step] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
            else:
                ref["norm"][step] = global_norm(grads64(model))
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if user_steps:
                monitor.step(loss=loss)
        transfers.append(counter.calls)
    monitor.close()
    handle.remove()
    return ref, transfers


@pytest.mark.parametrize("autocast", [None, torch.bfloat16, torch.float16], ids=["fp32", "autocast-bf16",
                                                                             "autocast-fp16"])
@pytest.mark.parametrize("user_steps", [True, False], ids=["monitor.step", "no-monitor.step"])
def test_amp_gradients_are_what_the_optimizer_uses(tmp_path, user_steps, autocast):
    if autocast is torch.float16 and _fp16_reason():
        pytest.skip(_fp16_reason())
    ref, transfers = _amp_run(tmp_path, user_steps=user_steps, clip=0.05, autocast=autocast)
    assert OVERFLOW_STEP not in ref["used"], "the scaler was expected to skip the overflow step"
    values = scalars(tmp_path)
    # every step is a step, the skipped one included (the scaler's update ends it)
    assert list(values.index) == list(range(STEPS))
    reduced, unreduced = rows(tmp_path, "grad_reduced"), rows(tmp_path, "grad_unreduced")
    params = rows(tmp_path, "param")
    for step in range(STEPS):
        assert values.loc[step, "loss_scale"] == ref["scale"][step]
        assert values.loc[step, "step_skipped"] == (1.0 if step == OVERFLOW_STEP else 0.0)
        if step == OVERFLOW_STEP:
            assert not (reduced.step == step).any() and not (params.step == step).any()
            assert not np.isfinite(values.loc[step, "grad_norm"])
            continue
        assert_rows_match(reduced, step, ref["used"][step])          # unscaled and clipped
        assert_rows_match(unreduced, step, ref["unscaled"][step])    # unscaled, before clipping
        assert_rows_match(params, step, ref["param"][step])
        # the pre-clip norm: what clip_grad_norm_ returned (and every framework logs)
        assert np.isclose(values.loc[step, "grad_norm"], ref["norm"][step], rtol=1e-5)
        assert ref["norm"][step] > 0.05  # clipping was active: the post-clip norm would be 0.05
    # the overflow is a recorded fact, not a non-finite alarm
    jsonl = rank_dir(tmp_path) / "anomalies.jsonl"
    events = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    assert events == []
    if user_steps:
        assert all(calls == ["cpu"] for calls in transfers), transfers  # one transfer per collected step


def test_without_the_scaler_gradients_are_scaled_but_the_step_is_still_counted(tmp_path):
    """Without ``scaler=``: grad_reduced is still what the optimizer used (after unscale_), and a
    skipped step is inferred from the optimizer's step not running."""
    ref, _ = _amp_run(tmp_path, user_steps=True, clip=None, pass_scaler=False)
    values = scalars(tmp_path)
    assert values.loc[OVERFLOW_STEP, "step_skipped"] == 1.0 and values.loc[0, "step_skipped"] == 0.0
    reduced = rows(tmp_path, "grad_reduced")
    for step in (0, 1, 2, 4):
        assert_rows_match(reduced, step, ref["used"][step])


@pytest.mark.parametrize("params", [["*"], ["fc1.*"]], ids=["every-parameter", "one-layer"])
def test_clipping_without_amp_reports_the_pre_clip_norm(tmp_path, params):
    """Every parameter a target: the norm comes from the grad_unreduced partials (no second read of the
    gradients); one layer: from the gradients themselves. Both are the norm over every gradient."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    used, norms = {}, {}
    monitor = TrainerMonitor(config(tmp_path, targets={"modules": ["*"], "params": params})).attach(model, optimizer)
    handle = optimizer.register_step_pre_hook(lambda opt, a, k: used.__setitem__(step, grads64(model)))
    for step in range(4):
        x, y = data(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        norms[step] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.01))
        optimizer.step()
        optimizer.zero_grad()
        monitor.step()
    monitor.close()
    handle.remove()
    values, reduced = scalars(tmp_path), rows(tmp_path, "grad_reduced")
    for step in range(4):
        assert np.isclose(values.loc[step, "grad_norm"], norms[step], rtol=1e-5)
        assert norms[step] > 0.01
        assert_rows_match(reduced, step, {name: g for name, g in used[step].items()
                                          if params == ["*"] or name.startswith("fc1.")})  # what SGD stepped with
        assert np.isclose(global_norm(used[step]), 0.01, rtol=1e-4)
