"""The ``precursors`` family (docs/precursors.md) of plain torch Adam and AdamW (single-tensor, foreach and fused
implementations) against float64 numpy from the tensors the step really used: the gradient, the moments after the
step, and the weights before and after it (the update-to-weight ratio is measured on the weights: the applied step
``param_before - param_after``, less AdamW's decoupled decay ``lr * wd * param_before``)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tests.models import TinyNet, batch, loss_fn
from tests.reference import precursors_np, read_family
from trainmon import TrainerMonitor
from trainmon.base.precursors import PRECURSOR_METRICS
from trainmon.tools.store import open_run

LR = 1e-2


def _train(tmp_path, optimizer_class, implementation: str, weight_decay: float, eps: float = 1e-8,
           sinks: tuple[str, ...] = ("csv",), steps: int = 3) -> tuple[dict, torch.nn.Module]:
    torch.manual_seed(0)
    model = TinyNet()
    with torch.no_grad():
        model.layers[0].fc1.bias.zero_()  # zero weights before the first step
    options = {"foreach": implementation == "foreach", "fused": implementation == "fused"} \
        if implementation != "default" else {}
    optimizer = optimizer_class(model.parameters(), lr=LR, weight_decay=weight_decay, eps=eps, **options)
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": list(sinks),
              "optimizer_states": {"states": ["update"], "precursors": True}}
    decoupled = optimizer_class is torch.optim.AdamW
    ref: dict[tuple[str, int], dict[str, float]] = {}
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer)
        for step in range(steps):
            loss = loss_fn(model, *batch(step))
            loss.backward()
            before = {name: p.detach().double().numpy().copy() for name, p in model.named_parameters()}
            optimizer.step()
            group = optimizer.param_groups[0]
            for name, p in model.named_parameters():
                state = optimizer.state[p]
                after = p.detach().double().numpy()
                applied = before[name] - after
                adam_step = applied - LR * weight_decay * before[name] if decoupled else applied
                ref[(name, step)] = precursors_np(
                    p.grad.double().numpy(), state["exp_avg"].double().numpy(), state["exp_avg_sq"].double().numpy(),
                    after, float(state["step"]), group["betas"], eps, LR, adam_step,
                    coupled_decay=0.0 if decoupled else weight_decay, param_before=before[name])
            optimizer.zero_grad()
            monitor.step(loss=loss)
    return ref, model


def _assert_rows(rows: list[dict], ref: dict, n_params: int, steps: int = 3) -> None:
    assert len(rows) == steps * n_params
    for row in rows:
        want = ref[(row["name"], row["step"])]
        for metric in PRECURSOR_METRICS:
            got = float(row[metric])
            assert math.isclose(got, want[metric], rel_tol=1e-3, abs_tol=1e-6), \
                (row["name"], row["step"], metric, got, want[metric])


@pytest.mark.parametrize("implementation", ["default", "foreach", "fused"])
@pytest.mark.parametrize(("optimizer_class", "weight_decay"), [(torch.optim.Adam, 0.01), (torch.optim.AdamW, 0.1)],
                         ids=["adam", "adamw"])
def test_precursors_match_float64_from_the_weights(tmp_path, optimizer_class, weight_decay, implementation):
    ref, model = _train(tmp_path, optimizer_class, implementation, weight_decay)
    frame = read_family(tmp_path / "run" / "rank0", "precursors")
    assert list(frame.columns) == ["vpp_stage", "name", "step", "micro_step", *PRECURSOR_METRICS]
    _assert_rows(frame.to_dict("records"), ref, len(list(model.parameters())))
    # the first step of a zero-initialised bias: the ratio to a weight that was 0 is finite, its moments agree
    first = frame[(frame["name"] == "layers.0.fc1.bias") & (frame["step"] == 0)].iloc[0]
    assert math.isfinite(first["update_weight_ratio"]) and first["cos_m_g"] == pytest.approx(1.0, abs=1e-6)
    # at step 1 v_hat = g^2 (g: with Adam's coupled decay): r is 1 where |g| > eps, 0 where g = 0 (embedding rows
    # that no token used)
    assert (frame.loc[frame["step"] == 0, "g2_v_rms"] <= 1 + 1e-6).all()


def test_eps_underflow_and_the_store(tmp_path):
    """A large eps puts small-gradient elements under it; the rows read back from the run store (DuckDB)."""
    ref, model = _train(tmp_path, torch.optim.Adam, "default", 0.0, eps=1e-3, sinks=("parquet",))
    con = open_run(tmp_path / "run")
    rows = con.sql("SELECT * FROM precursors ORDER BY step, name").df().to_dict("records")
    _assert_rows(rows, ref, len(list(model.parameters())))
    underflow = [row["eps_underflow"] for row in rows]
    assert any(0 < value < 1 for value in underflow), underflow
    assert {row["rank"] for row in rows} == {0}


def test_off_by_default_and_sgd_has_none(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
              "optimizer_states": {"states": ["momentum"], "precursors": True}}
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer)
        for step in range(2):
            loss_fn(model, *batch(step)).backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    rank_dir = tmp_path / "run" / "rank0"
    assert not (rank_dir / "precursors.csv").exists()
    assert (rank_dir / "momentum.csv").exists()
    off = tmp_path / "off"
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters())
    with TrainerMonitor({"output_dir": str(off), "run_name": "run", "sinks": ["csv"]}) as monitor:
        monitor.attach(model, optimizer)
        loss_fn(model, *batch(0)).backward()
        optimizer.step()
        monitor.step()
    assert not (off / "run" / "rank0" / "precursors.csv").exists()
    assert (off / "run" / "rank0" / "update.csv").exists()


def test_a_spike_detector_on_a_precursor_series(tmp_path):
    """``precursors/{name}/{metric}`` is a series of the ``spike`` detector, as ``grad_reduced/*/norm`` is."""
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
              "optimizer_states": {"precursors": True},
              "anomaly": {"default_detectors": False, "detectors": [
                  {"type": "spike", "series": ["precursors/*/g2_v_rms"], "method": "relative", "threshold": 0.5,
                   "warmup": 2}]}}
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer)
        for step in range(6):
            loss = loss_fn(model, *batch(step))
            loss.backward()
            if step == 5:  # a gradient 100x its history: v is out of date, g^2 / v_hat jumps
                for p in model.parameters():
                    p.grad.mul_(100.0)
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(loss=loss)
    lines = (tmp_path / "run" / "rank0" / "anomalies.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    fired = {(event["family"], event["metric"], event["step"]) for event in events}
    assert fired == {("precursors", "g2_v_rms", 5)}, fired
    assert len(events) == len(list(model.parameters()))
    frame = read_family(tmp_path / "run" / "rank0", "precursors")
    # r <= (1 - beta2^t) / (1 - beta2): at step 6 with beta2 = 0.999 the root mean is at most sqrt(5.985)
    jump = frame[frame["step"] == 5]["g2_v_rms"].to_numpy() / frame[frame["step"] == 4]["g2_v_rms"].to_numpy()
    assert np.all(jump > 1.8) and np.all(frame["g2_v_rms"] <= np.sqrt((1 - 0.999 ** 6) / 0.001)), jump


@pytest.mark.filterwarnings("ignore:Detected call of .lr_scheduler.step")
@pytest.mark.parametrize("kind", ["adam_fused", "adamw_foreach"])
def test_a_step_the_guard_skips_has_no_precursors(tmp_path, kind):
    """The step guard skips a step with a NaN gradient: on the fused path (the optimizer is called with the skip flag)
    its precursor rows are empty (NaN values, no alarm), on the host path (not called) there are none; no
    ``nonfinite`` event names a precursor row, the steps around it have their rows."""
    from tests.integration.test_step_guard import GUARD, STEPS, train

    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"],
                              "optimizer_states": {"precursors": True},
                              "anomaly": {"guard": GUARD, "detectors": [{"type": "nonfinite"}]}})
    model, _ = train(kind, poison="nan", bad=6, monitor=monitor)
    rank_dir = tmp_path / "run" / "rank0"
    frame = read_family(rank_dir, "precursors")
    n_params = len(list(model.parameters()))
    bad = frame[frame["step"] == 6]
    if kind == "adam_fused":
        assert len(bad) == n_params and bad[list(PRECURSOR_METRICS)].isna().all().all()
    else:
        assert bad.empty
    good = frame[frame["step"] != 6]
    assert len(good) == (STEPS - 1) * n_params and np.isfinite(good[list(PRECURSOR_METRICS)]).all().all()
    events = [json.loads(line) for line in (rank_dir / "anomalies.jsonl").read_text().splitlines()]
    assert not [event for event in events if event["family"] == "precursors"], events
