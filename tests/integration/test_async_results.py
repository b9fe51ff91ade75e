"""``async_results: true``: a collected step is finished when the next step ends (its copy to the host is
started without waiting for the device). The rows equal those of the same run finished at once, which
the float64-reference tests check; records come back one step later; anomalies and ``raise`` one step
later; the last collected step is finished by ``close``. On CPU the copy is immediate; on a GPU,
tests/gpu/test_cuda.py checks that a step then makes no synchronisation at all."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from tests.integration.test_anomaly_models import Net, read_events
from tests.integration.test_anomaly_models import train as train_with_fault
from tests.models import TinyNet, batch, loss_fn
from tests.reference import METRICS, assert_close, np_stats, read_family
from trainmon import TrainerMonitor
from trainmon.errors import AnomalyError

ALL = {"enabled": True, "metrics": METRICS}
FAMILIES = ("actv", "actv_grad", "grad_unreduced", "grad_reduced", "param", "exp_avg", "exp_avg_sq", "update", "ratio")


def _run(tmp_path, name: str, dtype: torch.dtype, steps: int = 4, **config):
    torch.manual_seed(0)
    model = TinyNet().to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": name, "sinks": ["csv"], "activations": ALL,
                              "weight_grads": {"metrics": METRICS, "unreduced": True}, "params": ALL,
                              "optimizer_states": {"metrics": METRICS}, **config}).attach(model, optimizer)
    returned, grads = [], {}
    for step in range(steps):
        loss = loss_fn(model, *batch(step))
        loss.float().backward()
        grads[step] = {n: p.grad.double().numpy().copy() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        record = monitor.step(loss=loss)
        returned.append(None if record is None else record.step)
    monitor.close()
    return returned, grads, tmp_path / name / "rank0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_equal_those_finished_at_once_and_records_come_one_step_later(tmp_path, dtype):
    now, grads, now_dir = _run(tmp_path, "now", dtype)
    later, _, later_dir = _run(tmp_path, "later", dtype, async_results=True)
    assert now == [0, 1, 2, 3]
    assert later == [None, 0, 1, 2]  # step 3 is finished by close()
    for family in FAMILIES:
        a, b = read_family(now_dir, family), read_family(later_dir, family)
        assert len(a) and list(a.step) == list(b.step) and list(a.name) == list(b.name), family
        np.testing.assert_array_equal(a[METRICS].to_numpy(float), b[METRICS].to_numpy(float), err_msg=family)
    scalars = [pd.read_csv(d / "scalars.csv") for d in (now_dir, later_dir)]
    pd.testing.assert_frame_equal(*scalars)
    reduced = read_family(later_dir, "grad_reduced")
    for _, row in reduced[reduced.step == 3].iterrows():  # the step close() finished, against float64
        assert_close(row, np_stats(grads[3][row["name"]]), METRICS, rtol=1e-5 if dtype == torch.float32 else 1e-3)


def test_an_uncollected_step_finishes_the_previous_collected_one(tmp_path):
    returned, _, rank_dir = _run(tmp_path, "interval", torch.float32, steps=5, async_results=True, step_interval=2)
    assert returned == [None, 0, None, 2, None]
    assert sorted(set(read_family(rank_dir, "grad_reduced").step)) == [0, 2, 4]


def test_raise_comes_one_step_later_and_names_the_step_of_the_fault(tmp_path):
    torch.manual_seed(0)
    model = Net()
    monitor = TrainerMonitor({"output_dir": str(tmp_path), "run_name": "run", "sinks": [], "async_results": True,
                              "activations": {"enabled": True, "metrics": ["norm", "nans"]},
                              "anomaly": {"actions": ["jsonl", "raise"]}})
    steps_run = []
    with pytest.raises(AnomalyError, match=r"first non-finite value at step 3, micro-step 0, rank 0: "
                                           r"forward output of layers\.2 "):
        try:
            train_with_fault(model, monitor, 10, fault=(3, 2, "forward"), before_step=steps_run.append)
        finally:
            monitor.close()
    assert steps_run[-1] == 4  # raised at the end of step 4, when step 3 was finished
    # step 4 ran (its weights are NaN after step 3's update) and is finished by close(): its event is written too
    assert [e["step"] for e in read_events(tmp_path / "run" / "rank0" / "anomalies.jsonl")] == [3, 4]


def test_anomaly_actions_come_one_step_later(tmp_path):
    """The NaN of step 5 is seen when step 6 ends: the dump and the free benchmark of its module run on step 7
    (step 6 when finished at once: tests/integration/test_monitor_actions.py)."""
    from tests.integration.test_monitor_actions import train as train_with_nan_at_step5

    monitor = TrainerMonitor({
        "output_dir": str(tmp_path), "run_name": "run", "sinks": [], "async_results": True,
        "activations": {"enabled": True, "metrics": ["norm", "nans"]},
        "weight_grads": {"enabled": False}, "optimizer_states": {"enabled": False},
        "anomaly": {"detectors": [{"type": "nonfinite"}], "actions": ["jsonl", "dump", "free_benchmark"]},
        "dump": {"enabled": True, "depth": 0}, "free_benchmark": {"enabled": True, "pert_mode": "change_value"}})
    train_with_nan_at_step5(monitor)
    rank_dir = tmp_path / "run" / "rank0"
    assert [e["step"] for e in read_events(rank_dir / "anomalies.jsonl")] == [5]
    assert sorted(p.name for p in (rank_dir / "dump").iterdir()) == ["step2", "step7"]  # step 2: asked by hand
    dumped = json.loads((rank_dir / "dump" / "step7" / "dump.json").read_text())["data"]
    assert set(dumped) == {"Module.layers.2.Block.forward.0", "Module.layers.2.Block.backward.0"}
    checks = pd.read_csv(rank_dir / "free_benchmark.csv")
    assert list(zip(checks["step"], checks["name"])) == [(3, "layers.1"), (7, "layers.2")]
