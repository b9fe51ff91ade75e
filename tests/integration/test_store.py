"""The run store (``sinks: [parquet]``) of a real torch loop: every row and scalar read back through
``open_run`` (DuckDB) equals what the CSV sink wrote, exactly, and float64 numpy references of the tensors
torch really used; ``trainmon query`` over that run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from tests.models import TinyNet, batch, loss_fn
from tests.reference import METRICS, adam_update_np, np_stats
from trainmon import AnomalyEvent, TrainerMonitor
from trainmon.tools.store import open_run

ALL = {"enabled": True, "metrics": METRICS}
FAMILIES = ["actv", "actv_grad", "grad_unreduced", "grad_reduced", "param", "exp_avg", "exp_avg_sq", "update", "ratio"]
STEPS = 4


def _csv(rank_dir: Path, family: str) -> pd.DataFrame:
    # round_trip: pandas' default float parser may differ from Python's float() in the last bit
    return pd.read_csv(rank_dir / f"{family}.csv", keep_default_na=False, na_values=["nan"],
                       float_precision="round_trip")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-step AdamW run of TinyNet with every family, written to Parquet and CSV, and the references."""
    out = tmp_path_factory.mktemp("store")
    torch.manual_seed(0)
    model = TinyNet()
    with torch.no_grad():
        model.layers[0].fc1.bias.zero_()  # exact zeros: the zeros metric and the ratio's param == 0 rule
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    config = {"output_dir": str(out), "run_name": "run", "sinks": ["parquet", "csv"],
              "activations": ALL, "weight_grads": ALL, "params": ALL,
              "optimizer_states": {"metrics": METRICS, "states": ["exp_avg", "exp_avg_sq", "update", "ratio"]},
              "anomaly": {"detectors": [{"type": "nonfinite"}], "actions": ["jsonl"]}}
    reference: dict[tuple[str, str, int], np.ndarray] = {}
    losses = []
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer, grad_acc_steps=2)  # two micro-steps: rows with micro_step 0 and 1
        for step in range(STEPS):
            if step == STEPS - 1:  # a NaN weight in the last step: nonfinite rows and NaN values from there on
                with torch.no_grad():
                    model.layers[1].fc2.weight[0, 0] = float("nan")
            for micro_step in range(2):
                loss = loss_fn(model, *batch(2 * step + micro_step)) / 2
                loss.backward()
            for name, p in model.named_parameters():
                reference[("grad_reduced", name, step)] = p.grad.double().numpy().copy()
                reference[("param", name, step)] = p.detach().double().numpy().copy()
            optimizer.step()
            for name, p in model.named_parameters():
                state = optimizer.state[p]
                reference[("exp_avg", name, step)] = state["exp_avg"].double().numpy().copy()
                reference[("update", name, step)] = adam_update_np(
                    state["exp_avg"].numpy(), state["exp_avg_sq"].numpy(), float(step + 1), (0.9, 0.999), 1e-8)
            optimizer.zero_grad()
            monitor.step(loss=loss)
            losses.append(float(loss.detach()))
    return out / "run", reference, losses


def test_every_row_equals_the_csv(run):
    run_dir, _, _ = run
    con = open_run(run_dir)
    for family in FAMILIES:
        csv = _csv(run_dir / "rank0", family)
        assert len(csv) > 0, family
        stored = con.sql(f"SELECT * FROM {family}").df()
        assert set(stored["rank"]) == {0}
        keys = ["step", "micro_step", "vpp_stage", "name"]
        csv = csv.sort_values(keys, kind="stable").reset_index(drop=True)
        stored = stored.sort_values(keys, kind="stable").reset_index(drop=True)
        assert len(stored) == len(csv), family
        for column in keys:
            assert stored[column].tolist() == csv[column].tolist(), (family, column)
        for metric in METRICS:  # bit for bit, NaN where the CSV has nan
            np.testing.assert_array_equal(stored[metric].to_numpy(np.float64), csv[metric].to_numpy(np.float64),
                                          err_msg=f"{family} {metric}")
        assert str(stored[METRICS[0]].dtype) == "float64"
        # the nonfinite flag is the tensor's own: a NaN min or max, or a NaN/Inf count
        flagged = stored["min"].isna() | stored["max"].isna() | (stored["nans"] > 0) | (stored["infs"] > 0) \
            | ~np.isfinite(stored["min"]) | ~np.isfinite(stored["max"])
        assert stored["nonfinite"].tolist() == flagged.tolist(), family
    assert con.execute("SELECT count(*) FROM grad_reduced WHERE nonfinite").fetchall()[0][0] >= 1
    assert con.execute("SELECT DISTINCT micro_step FROM actv ORDER BY 1").fetchall() == [(0,), (1,)]


def test_scalars_equal_the_csv_and_the_loop(run):
    run_dir, _, losses = run
    con = open_run(run_dir)
    stored = con.sql("SELECT step, name, value FROM scalars").df().sort_values(["step", "name"], kind="stable")
    csv = _csv(run_dir / "rank0", "scalars").sort_values(["step", "name"], kind="stable")
    assert stored["name"].tolist() == csv["name"].tolist()
    assert stored["step"].tolist() == csv["step"].tolist()
    np.testing.assert_array_equal(stored["value"].to_numpy(), csv["value"].to_numpy())
    loss = con.sql("SELECT value FROM scalars WHERE name = 'loss' ORDER BY step").fetchall()
    assert [value for (value,) in loss][:-1] == losses[:-1]  # float32 losses, exactly as float64
    assert np.isnan(loss[-1][0]) and np.isnan(losses[-1])


def test_rows_equal_float64_numpy_references(run):
    run_dir, reference, _ = run
    con = open_run(run_dir)
    checked = 0
    for family in ("grad_reduced", "param", "exp_avg", "update"):
        for row in con.sql(f"SELECT * FROM {family}").df().itertuples():
            want = np_stats(reference[(family, row.name, row.step)])
            for metric in METRICS:
                got = getattr(row, metric)
                if np.isnan(want[metric]):
                    assert np.isnan(got), (family, row.name, metric)
                else:
                    assert np.isclose(got, want[metric], rtol=1e-5, atol=1e-7), (family, row.name, metric, got, want)
            checked += 1
    assert checked == 4 * STEPS * len(list(TinyNet().parameters()))


def test_anomalies_view_and_first_nonfinite_origin(run):
    run_dir, _, _ = run
    con = open_run(run_dir)
    events = con.sql("SELECT step, rank, family, name, detector FROM anomalies ORDER BY step").fetchall()
    assert events and events[0][0] == STEPS - 1 and events[0][4] == "nonfinite"
    # the stored param row of the NaN weight is non-finite in the last step only
    rows = con.sql("SELECT step FROM param WHERE name = 'layers.1.fc2.weight' AND nonfinite ORDER BY step").fetchall()
    assert [step for (step,) in rows] == [STEPS - 1]
    # the first non-finite row in execution order (forward < backward < optimizer, then order) is an activation
    columns = 'phase, name, step, micro_step, "order"'
    first = con.sql(f"SELECT phase, name FROM (SELECT {columns} FROM actv WHERE nonfinite UNION ALL "
                    f"SELECT {columns} FROM actv_grad WHERE nonfinite) ORDER BY step, micro_step, "
                    "CASE phase WHEN 'forward' THEN 0 ELSE 1 END, \"order\" LIMIT 1").fetchall()
    assert first == [("forward", "layers.1.fc2.output")], first


def test_anomaly_events_are_stored_at_close(run):
    run_dir, _, _ = run
    (stored,) = (run_dir / "store" / "anomalies" / "rank=0").iterdir()
    jsonl = (run_dir / "rank0" / "anomalies.jsonl").read_text()
    assert stored.name == f"events-{0:015d}-{len(jsonl.encode()):015d}.parquet"
    want = [AnomalyEvent.from_json(line) for line in jsonl.splitlines()]
    got = open_run(run_dir).sql("SELECT * FROM anomalies").df()
    assert len(got) == len(want) > 0
    for event, row in zip(want, got.itertuples()):
        for field in ("step", "micro_step", "rank", "phase", "order", "detector", "family", "name", "metric",
                      "message", "time"):
            assert getattr(row, field) == getattr(event, field), field
        for field in ("value", "baseline"):
            np.testing.assert_array_equal(getattr(row, field), getattr(event, field))


def test_store_files_are_merged_at_close(run):
    run_dir, _, _ = run
    for family in FAMILIES + ["scalars"]:
        files = list((run_dir / "store" / family / "rank=0").glob("*.parquet"))
        assert len(files) == 1 and files[0].name.startswith("part-000000000-000000003-"), (family, files)
        marks = list((run_dir / "store" / family / "rank=0").glob("_schema-*.json"))  # one schema, marked
        assert len(marks) == 1 and marks[0].name.startswith(f"_schema-{files[0].name.split('-')[3]}-")


def _query(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainmon", "query", *args], capture_output=True, text=True,
                          timeout=120)


def test_query_cli(run, tmp_path):
    run_dir, _, _ = run
    done = _query(str(run_dir), "SELECT step, value FROM scalars WHERE name = 'loss' ORDER BY step", "--format", "csv")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "step,value" and len(done.stdout.splitlines()) == STEPS + 1
    listed = _query(str(run_dir), "--tables")
    assert listed.returncode == 0 and "grad_reduced: step BIGINT" in listed.stdout and "rank BIGINT" in listed.stdout
    (tmp_path / "plain").mkdir()
    for args, says in [((str(run_dir), "SELECT * FROM nope"), "nope"),
                       ((str(run_dir), "SELEC 1"), "syntax error"),
                       ((str(run_dir), "SELECT 1; SELECT 2"), "one statement"),
                       ((str(run_dir), f"COPY grad_reduced TO '{tmp_path}/x.csv'"), "only a SELECT"),
                       ((str(run_dir), "SELECT nope FROM scalars"), "nope"),
                       ((str(tmp_path / "missing"), "SELECT 1"), "does not exist"),
                       ((str(tmp_path / "plain"), "SELECT 1"), "no store/"),
                       ((str(run_dir.parent), "SELECT 1"), "folder of runs"),
                       ((str(run_dir),), "give a SQL query"),
                       ((str(run_dir), "SELECT 1", "--max-rows", "0"), "--max-rows")]:
        done = _query(*args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
        assert says in done.stderr, (args, done.stderr)
    assert not (tmp_path / "x.csv").exists()
