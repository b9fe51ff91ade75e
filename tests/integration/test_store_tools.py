"""``trainmon report``, ``csv2tb`` and ``analyse`` on a run written with ``sinks: [parquet]`` only: a real torch loop
written once with both sinks, then copied without its CSV files; every tool gives on the copy what it gives from
the CSV files of the same run."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.models import TinyNet, batch, loss_fn
from tests.reference import METRICS
from tests.unit.test_store_reader import csv_only_copy, store_only_copy, tags_and_points
from trainmon import TrainerMonitor
from trainmon.tools.cli import main
from trainmon.tools.readers import read_table
from trainmon.tools.store_reader import StoreFamily, read_source, store_families

ALL = {"enabled": True, "metrics": METRICS}
STEPS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(run with CSV and store, copy with the store only)``: 4 AdamW steps of TinyNet, 2 micro-steps, a NaN
    weight in the last step (non-finite rows and anomaly events)."""
    out = tmp_path_factory.mktemp("store_tools")
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"output_dir": str(out), "run_name": "run", "sinks": ["parquet", "csv"],
              "activations": ALL, "weight_grads": ALL,
              "optimizer_states": {"metrics": METRICS, "states": ["exp_avg", "exp_avg_sq", "update"]},
              "anomaly": {"detectors": [{"type": "nonfinite"}], "actions": ["jsonl"]}}
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer, grad_acc_steps=2)
        for step in range(STEPS):
            if step == STEPS - 1:
                with torch.no_grad():
                    model.layers[1].fc2.weight[0, 0] = float("nan")
            for micro_step in range(2):
                loss = loss_fn(model, *batch(2 * step + micro_step)) / 2
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(loss=loss)
    run_dir = out / "run"
    return run_dir, store_only_copy(run_dir, out / "store_only")


def _same_table(left, right) -> None:
    assert (left.family, left.metrics, left.keys) == (right.family, right.metrics, right.keys)
    for column in ("rows", "steps", "micro_steps"):
        a, b = getattr(left, column), getattr(right, column)
        assert a.dtype == b.dtype and np.array_equal(a, b), column
    assert left.values.dtype == right.values.dtype == np.float64
    assert np.array_equal(left.values, right.values, equal_nan=True)  # bit-equal, NaN and Inf as written


def test_reader_gives_the_csv_tables(runs):
    run_dir, store_only = runs
    families = store_families(store_only)[0]
    assert {f.family for f in families} == {p.stem for p in (run_dir / "rank0").glob("*.csv")}
    nonfinite = 0
    for family in families:
        (table,), held = read_source(family)
        _same_table(read_table(run_dir / "rank0" / f"{family.family}.csv"), table)
        assert held == set(table.metrics)
        nonfinite += int((~np.isfinite(table.values)).sum())
    assert nonfinite > 0  # the NaN weight's rows are compared too


def test_reader_reads_only_the_metrics_asked_for(runs):
    _, store_only = runs
    family = next(f for f in store_families(store_only)[0] if f.family == "grad_reduced")
    (table,), held = read_source(family, metrics=["norm", "nans"])
    assert table.metrics == ["norm", "nans"] and table.values.shape[1] == 2
    assert held == set(METRICS)


def _page_data(path: Path) -> dict:
    match = re.search(r'<script id="report-data" type="application/json">(.*?)</script>', path.read_text(), re.S)
    data = json.loads(match.group(1))
    for key in ("run_dir", "run_name", "generated"):
        data["summary"].pop(key)
    return data


@pytest.mark.parametrize("options", [[], ["--families", "grad_reduced", "actv", "--metrics", "norm", "nans"]])
def test_report_equals_the_csv_report(runs, tmp_path, capsys, options):
    """The page from the store equals the page from the CSV files of the same run (every grid, curve and row);
    a run with both is read from its store."""
    run_dir, store_only = runs
    csv_only = csv_only_copy(run_dir, tmp_path / "csv_only")
    assert main(["report", str(csv_only), "-o", str(tmp_path / "csv.html"), *options]) == 0
    assert re.search(r"read \d+ CSV files of 1 rank", capsys.readouterr().out)
    assert main(["report", str(store_only), "-o", str(tmp_path / "store.html"), *options]) == 0
    assert re.search(r"read \d+ store tables of 1 rank", capsys.readouterr().out)
    assert main(["report", str(run_dir), "-o", str(tmp_path / "both.html"), *options]) == 0
    assert re.search(r"read \d+ store tables of 1 rank", capsys.readouterr().out)
    from_csv, from_store = _page_data(tmp_path / "csv.html"), _page_data(tmp_path / "store.html")
    assert from_csv["grids"] and from_csv["curves"]["0"]["loss"]["steps"] == list(range(STEPS))
    assert _page_data(tmp_path / "both.html") == from_store
    assert from_csv["anomalies"]["present"] and from_csv["anomalies"]["first_origin"] is not None
    assert from_store == from_csv


@pytest.mark.parametrize("options", [[], ["--per-tensor"]])
def test_csv2tb_equals_the_csv_conversion(runs, tmp_path, capsys, options):
    run_dir, store_only = runs
    assert main(["csv2tb", str(run_dir), "-o", str(tmp_path / "csv"), *options]) == 0
    csv_out = capsys.readouterr().out
    assert main(["csv2tb", str(store_only), "-o", str(tmp_path / "store"), *options]) == 0
    store_out = capsys.readouterr().out
    assert "read trainmon store" in store_out and "msprobe" not in store_out
    assert csv_out.splitlines()[-1].split(" to ")[0] == store_out.splitlines()[-1].split(" to ")[0]  # wrote N scalars
    from_csv, from_store = tags_and_points(tmp_path / "csv" / "rank0"), tags_and_points(tmp_path / "store" / "rank0")
    assert set(from_store) == set(from_csv) and len(from_csv) > (100 if options else 20)
    assert ("grad_reduced/head.weight/norm/micro1" in from_csv) == bool(options) and "grad_reduced/norm_max" in from_csv
    for tag, points in from_csv.items():
        other = from_store[tag]
        assert [s for s, _ in other] == [s for s, _ in points], tag
        assert all(a == b or (math.isnan(a) and math.isnan(b)) for (_, a), (_, b) in zip(points, other)), tag
    assert any(math.isnan(v) for points in from_csv.values() for _, v in points)


def test_csv2tb_families_filter_on_a_store_run(runs, tmp_path):
    _, store_only = runs
    assert main(["csv2tb", str(store_only), "-o", str(tmp_path / "tb"), "--families", "actv"]) == 0
    assert {tag.split("/")[0] for tag in tags_and_points(tmp_path / "tb" / "rank0")} == {"actv"}


def test_analyse_on_a_store_run(runs, tmp_path):
    run_dir, store_only = runs
    assert main(["analyse", str(run_dir), "-o", str(tmp_path / "csv.json")]) == 0
    assert main(["analyse", str(store_only), "-o", str(tmp_path / "store.json")]) == 0
    from_csv = json.loads((tmp_path / "csv.json").read_text())
    from_store = json.loads((tmp_path / "store.json").read_text())
    assert from_csv["first_origin"] is not None and from_csv["first_origin"]["step"] == STEPS - 1
    assert from_store["first_origin"] == from_csv["first_origin"]
    assert from_store["events"] == from_csv["events"]


@pytest.mark.parametrize("command", ["report", "csv2tb"])
def test_a_corrupt_part_is_one_line_exit_2(runs, tmp_path, capsys, command):
    _, store_only = runs
    broken = tmp_path / "broken"
    shutil.copytree(store_only, broken)
    part = next(f for f in store_families(broken)[0] if f.family == "grad_reduced").parts[0]
    part.write_bytes(b"not parquet at all")
    assert main([command, str(broken), "-o", str(tmp_path / ("out.html" if command == "report" else "tb"))]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and str(part) in err, err


def test_a_family_with_csv_files_is_read_from_them(runs, tmp_path):
    """A run with both: the CSV files are read, the store only for a family without one."""
    run_dir, _ = runs
    mixed = tmp_path / "mixed"
    shutil.copytree(run_dir, mixed)
    (mixed / "rank0" / "actv.csv").unlink()
    from trainmon.tools.report.data import sources

    found = sources(mixed)[0]
    assert [s.family for s in found if isinstance(s, StoreFamily)] == ["actv"]
    assert all(isinstance(s, StoreFamily) or s.name != "actv.csv" for s in found)
    every = sorted(p.stem for p in (run_dir / "rank0").glob("*.csv"))
    assert [s.family if isinstance(s, StoreFamily) else s.stem for s in found] == every
