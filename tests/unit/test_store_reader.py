"""The store reader (:mod:`trainmon.tools.store_reader`) against the CSV reader on runs written through both real
sinks: a resumed run whose two writers overlap in steps, a metric change mid-run, NaN and Inf, VPP stages and
micro-steps; ``trainmon report`` gives the same page from either."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from trainmon.base.records import Row, RowKey, StepRecord
from trainmon.sinks.csv import CsvSink
from trainmon.sinks.parquet import ParquetSink
from trainmon.tools.cli import main
from trainmon.tools.readers import read_scalars, read_table
from trainmon.tools.store_reader import StoreError, StoreFamily, read_source, source_scalars, store_families


def _write(run_dir: Path, steps: range, metrics: tuple[str, ...] = ("norm", "max"), roll: bool = True) -> None:
    """One writer (a run, or a resumed run) through the CSV and Parquet sinks of rank 0: the Parquet sink rolls
    a file per step and merges every two (so a family is read from several parts), or writes one file at close."""
    rank_dir = run_dir / "rank0"
    rank_dir.mkdir(parents=True, exist_ok=True)
    clock = iter(range(10**6))
    parquet = ParquetSink(rank_dir, root=run_dir, fan_in=2, clock=lambda: float(next(clock)) * 10 * roll)
    sinks = [CsvSink(rank_dir, root=run_dir), parquet]
    for step in steps:
        rows = []
        for micro_step in range(2):
            for order, (vpp, name) in enumerate([(0, "b.output"), (1, "a.output"), (0, "a.output")]):
                value = float(step * 10 + order) + 0.1 * micro_step + (0.01 if roll else 0.02)
                values = {m: value * (i + 1) for i, m in enumerate(metrics)}
                if step == 5 and name == "a.output":
                    values[metrics[0]] = math.nan if vpp else -math.inf
                rows.append(Row(RowKey("actv", name, micro_step, vpp, order), step, values, False))
        record = StepRecord(step=step, rank=0, rows=rows, scalars={"loss": 1.0 / (step + 1), "lr/group0": 0.1},
                            pp_stage=0)
        for sink in sinks:
            sink.write(record)
            sink.flush()
    for sink in sinks:
        sink.close()


def _same(left, right) -> None:
    assert (left.family, left.metrics, left.keys) == (right.family, right.metrics, right.keys)
    for column in ("rows", "steps", "micro_steps"):
        assert getattr(left, column).dtype == getattr(right, column).dtype
        assert np.array_equal(getattr(left, column), getattr(right, column)), column
    assert np.array_equal(left.values, right.values, equal_nan=True)


def _families(run_dir: Path) -> dict[str, StoreFamily]:
    return {family.family: family for family in store_families(run_dir)[0]}


def test_one_writer_equals_the_csv(tmp_path):
    _write(tmp_path / "run", range(8))
    families = _families(tmp_path / "run")
    assert len(families["actv"].parts) == 4
    for name in ("actv", "scalars"):
        (table,), held = read_source(families[name])
        _same(read_table(tmp_path / "run" / "rank0" / f"{name}.csv"), table)
        expected = list(read_scalars(tmp_path / "run" / "rank0" / f"{name}.csv"))
        assert [str(v) for v in source_scalars(families[name], set())] == [str(v) for v in expected]  # NaN too


@pytest.mark.parametrize("resumed_roll", [True, False])
def test_resumed_run_rows_as_the_csv_appended_them(tmp_path, resumed_roll):
    """Resumed from a checkpoint of step 1: steps 1..5 written twice, the second writer's rows after the first's
    (parts by step would interleave them: the resumed writer's single part 1-7 sorts before the first's 2-3)."""
    run_dir = tmp_path / "run"
    _write(run_dir, range(6))
    _write(run_dir, range(1, 8), roll=resumed_roll)
    families = _families(run_dir)
    assert len(families["actv"].parts) == (7 if resumed_roll else 4)  # 3 + 4 merged parts, or 3 + 1
    (table,), _ = read_source(families["actv"])
    csv = read_table(run_dir / "rank0" / "actv.csv")  # steps 0..5, then 1..7 as appended
    assert not np.all(np.diff(csv.steps) >= 0)
    _same(csv, table)
    expected = list(read_scalars(run_dir / "rank0" / "actv.csv"))
    assert [str(v) for v in source_scalars(families["actv"], set())] == [str(v) for v in expected]


def test_metric_change_gives_one_table_per_columns(tmp_path):
    run_dir = tmp_path / "run"
    _write(run_dir, range(4))
    _write(run_dir, range(4, 6), metrics=("norm",))  # another config: actv_4.csv, a part of its own columns
    _write(run_dir, range(6, 8))  # back: actv.csv again, parts of the first columns
    tables, held = read_source(_families(run_dir)["actv"])
    assert held == {"norm", "max"}
    csv = [read_table(path) for path in sorted((run_dir / "rank0").glob("actv*.csv"))]
    assert [t.metrics for t in csv] == [["norm", "max"], ["norm"]]
    for expected, table in zip(csv, tables, strict=True):
        _same(expected, table)


def test_metrics_pushdown_reads_only_those_columns(tmp_path):
    _write(tmp_path / "run", range(3))
    (table,), held = read_source(_families(tmp_path / "run")["actv"], metrics=["max"])
    full = read_table(tmp_path / "run" / "rank0" / "actv.csv")
    assert held == {"norm", "max"} and table.metrics == ["max"]
    assert np.array_equal(table.values[:, 0], full.values[:, 1])


def _page(path: Path) -> dict:
    data = json.loads(re.search(r'<script id="report-data" type="application/json">(.*?)</script>',
                                path.read_text(), re.S).group(1))
    for key in ("run_dir", "run_name", "generated"):
        data["summary"].pop(key)
    return data


def store_only_copy(run_dir: Path, copy: Path) -> Path:
    """A copy of ``run_dir`` without its CSV files (a run written with ``sinks: [parquet]`` only)."""
    shutil.copytree(run_dir, copy)
    removed = [path.unlink() or path for path in copy.rglob("*.csv")]
    assert removed and not list(copy.rglob("*.csv"))
    return copy


def csv_only_copy(run_dir: Path, copy: Path) -> Path:
    """A copy of ``run_dir`` without its store (a run written with ``sinks: [csv]`` only)."""
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "store")
    return copy


def _resumed_run(tmp_path: Path) -> tuple[Path, Path]:
    """A run resumed at step 1 (its second writer's store files: one part written at close), and its store-only
    copy."""
    run_dir = tmp_path / "run"
    _write(run_dir, range(6))
    _write(run_dir, range(1, 8), roll=False)
    return run_dir, store_only_copy(run_dir, tmp_path / "store_only")


def test_report_of_a_resumed_store_run_equals_the_csv_report(tmp_path):
    run_dir, store_only = _resumed_run(tmp_path)
    csv_only = csv_only_copy(run_dir, tmp_path / "csv_only")
    assert main(["report", str(csv_only), "-o", str(tmp_path / "csv.html"), "--max-columns", "10"]) == 0
    assert main(["report", str(store_only), "-o", str(tmp_path / "store.html"), "--max-columns", "10"]) == 0
    assert _page(tmp_path / "store.html") == _page(tmp_path / "csv.html")


def tags_and_points(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """``tag -> [(step, value), ...]`` of the event files in ``directory``, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0}).Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.parametrize("batch", [None, 4])
def test_csv2tb_of_a_resumed_store_run_equals_the_csv_conversion(tmp_path, monkeypatch, batch):
    """Also when the store is read in batches of 4 rows: a step's 6 rows come in two batches, joined again for the
    overview's summaries."""
    from trainmon.tools import store_reader

    if batch is not None:
        monkeypatch.setattr(store_reader, "_BATCH", batch)
    run_dir, store_only = _resumed_run(tmp_path)
    for options in ([], ["--per-tensor"]):
        assert main(["csv2tb", str(run_dir), "-o", str(tmp_path / "csv"), *options]) == 0
        assert main(["csv2tb", str(store_only), "-o", str(tmp_path / "store"), *options]) == 0
        from_csv = tags_and_points(tmp_path / "csv" / "rank0")
        from_store = tags_and_points(tmp_path / "store" / "rank0")
        assert from_csv and str(from_store) == str(from_csv)  # str: NaN equals NaN
        assert ("actv/a.output/norm" in from_csv) == bool(options) and "actv/norm_max" in from_csv
        shutil.rmtree(tmp_path / "csv")
        shutil.rmtree(tmp_path / "store")


@pytest.mark.parametrize("damage", ["truncated", "foreign"])
def test_a_bad_part_names_the_file(tmp_path, damage):
    _write(tmp_path / "run", range(3))
    family = _families(tmp_path / "run")["actv"]
    part = family.parts[1]
    if damage == "truncated":
        part.write_bytes(part.read_bytes()[:-40])
    else:  # a Parquet file of other columns
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"x": [1]}), part)
    with pytest.raises(StoreError, match=re.escape(str(part))):
        read_source(family)


@pytest.mark.parametrize("command", ["report", "csv2tb"])
def test_a_store_without_rank_folders_and_a_rank_folder_alone(tmp_path, capsys, command):
    run_dir = tmp_path / "run"
    _write(run_dir, range(3))
    shutil.rmtree(store_only_copy(run_dir, tmp_path / "bare") / "rank0")
    assert main([command, str(tmp_path / "bare"), "-o", str(tmp_path / "out.html" if command == "report" else
                                                            tmp_path / "tb"),
                 *(["--per-tensor"] if command == "csv2tb" else [])]) == 0
    if command == "csv2tb":
        assert tags_and_points(tmp_path / "tb" / "rank0")["actv/a.output/norm/vpp1"][0] == (0, pytest.approx(1.01))
    capsys.readouterr()
    (tmp_path / "bare" / "rank0").mkdir()
    assert main([command, str(tmp_path / "bare" / "rank0")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"its run {tmp_path / 'bare'} holds its statistics in store/" in err, err
