"""``trainmon convert``: a trainmon CSV run and msprobe's CSV output become a run store whose values are the CSV's
(float64, bit for bit, checked against the CSV text parsed by the csv module), with the order, phase and non-finite
flag derived as documented; ``query`` and ``analyse`` work on it; bad input exits 2 with one line, leaving nothing."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from trainmon.anomaly.events import AnomalyEvent
from trainmon.base.records import PHASE_OF_FAMILY, Row, RowKey, StepRecord
from trainmon.sinks.csv import CsvSink
from trainmon.tools import convert, readers
from trainmon.tools.cli import main
from trainmon.tools.msprobe_output import msprobe_rows
from trainmon.tools.store import open_run

DATA = Path(__file__).parent.parent / "data" / "msprobe_output"
SPECIAL = [math.nan, math.inf, -math.inf, -0.0, 5e-324, 1 / 3, 1e308]


def _record(step: int, rank: int, metrics: tuple[str, ...], rng: np.random.Generator) -> StepRecord:
    rows, order = [], 0
    for micro_step in range(2):
        for family, names in (("actv", ["layers.0.output", "layers.1.output.1", "a,b\"c"]),
                              ("grad_reduced", ["layers.0.weight"])):
            for vpp_stage in (0, 1):
                for name in names:
                    values = {m: float(rng.standard_normal() * 10.0 ** rng.integers(-30, 30)) for m in metrics}
                    if (step + order) % 5 == 0:
                        values[metrics[0]] = SPECIAL[(step + order) % len(SPECIAL)]
                    if "nans" in values:
                        values["nans"] = float((step + order) % 7 == 0)
                    rows.append(Row(RowKey(family, name, micro_step, vpp_stage, order), step, values, False))
                    order += 1
    return StepRecord(step=step, rank=rank, rows=rows, scalars={"loss": 1 / (step + 3), "lr/group0": 1e-3})


def write_csv_run(root: Path) -> Path:
    """Two ranks of CSV files; rank 0 changes its metrics at step 3 (``{family}_3.csv``), has a foreign CSV file
    and an ``anomalies.jsonl`` whose last line was cut short."""
    rng = np.random.default_rng(0)
    for rank in range(2):
        sink = CsvSink(root / f"rank{rank}", root)
        for step in range(6):
            metrics = ("norm", "min", "nans") if rank == 0 and step >= 3 else ("norm", "max", "mean", "nans", "infs")
            sink.write(_record(step, rank, metrics, rng))
        sink.close()
    (root / "rank0" / "free_benchmark.csv").write_text("rank,step,module\n0,1,x\n")
    events = [AnomalyEvent(2, 1, 0, "forward", "actv", "layers.0.output", "nans", 3.0, 0.0, "nonfinite", "m", 4,
                           0, 0, "2026-11-21T10:00:00.000Z").to_json() for _ in range(3)]
    (root / "rank0" / "anomalies.jsonl").write_text("\n".join(events) + "\n" + events[0][:30])
    return root


def _csv_rows(path: Path) -> tuple[list[str], list[list[str]]]:
    with open(path, newline="") as handle:
        header, *rows = list(csv.reader(handle))
    return header, rows


def _parts(store: Path, table: str, rank: int) -> list[Path]:
    """A table's parts of one rank in the order they were written (their sequence number)."""
    return sorted((store / table / f"rank={rank}").glob("part-*.parquet"), key=lambda p: p.name.split("-")[4])


def _read(path: Path):
    with open(path, "rb") as handle:
        return pq.read_table(handle)


def _bits(values) -> bytes:
    return np.asarray(values, dtype=np.float64).tobytes()


@pytest.fixture
def csv_run(tmp_path) -> Path:
    return write_csv_run(tmp_path / "run")


def test_a_csv_run_round_trips_exactly(csv_run, capsys):
    assert main(["convert", str(csv_run)]) == 0
    out = capsys.readouterr().out
    assert "skipped rank0/free_benchmark.csv" in out and "converted 8 trainmon CSV files of 2 ranks" in out
    store = csv_run / "store"
    for rank in range(2):
        files = sorted((csv_run / f"rank{rank}").glob("*.csv"))
        for family in ("actv", "grad_reduced"):
            parts = [_read(p) for p in _parts(store, family, rank)]
            sources = [p for p in files if readers.family_of(p) == family]
            assert len(parts) == len(sources) == (2 if rank == 0 else 1)
            for part, source in zip(parts, sources):
                header, rows = _csv_rows(source)
                assert part.column_names[:8] == ["step", "micro_step", "vpp_stage", "pp_stage", "order", "phase",
                                                 "name", "nonfinite"]
                assert part.column_names[8:] == header[4:]
                assert part.column("name").to_pylist() == [r[1] for r in rows]
                assert part.column("step").to_pylist() == [int(r[2]) for r in rows]
                assert part.column("micro_step").to_pylist() == [int(r[3]) for r in rows]
                assert part.column("vpp_stage").to_pylist() == [int(r[0]) for r in rows]
                assert set(part.column("phase").to_pylist()) == {PHASE_OF_FAMILY[family]}
                values = np.array([[float(text) for text in r[4:]] for r in rows])
                for i, metric in enumerate(header[4:]):
                    assert part.schema.field(metric).type == "double"
                    assert _bits(part.column(metric).to_numpy()) == _bits(values[:, i]), (source, metric)
                counts = [header.index(m) - 4 for m in ("nans", "infs") if m in header]
                flag = ~np.isfinite(values).all(axis=1) | (values[:, counts] > 0).any(axis=1)
                assert part.column("nonfinite").to_pylist() == flag.tolist()
                seen: dict[tuple[str, str], int] = {}
                orders = []
                for r in rows:  # the position among the file's rows of the same step and micro-step
                    orders.append(seen.get((r[2], r[3]), 0))
                    seen[r[2], r[3]] = orders[-1] + 1
                assert part.column("order").to_pylist() == orders
        header, rows = _csv_rows(csv_run / f"rank{rank}" / "scalars.csv")
        (scalars,) = [_read(p) for p in _parts(store, "scalars", rank)]
        assert scalars.column("name").to_pylist() == [r[1] for r in rows]
        assert _bits(scalars.column("value").to_numpy()) == _bits([float(r[2]) for r in rows])
    (events,) = (store / "anomalies" / "rank=0").iterdir()
    whole = (csv_run / "rank0" / "anomalies.jsonl").read_bytes()
    end = whole.rfind(b"\n") + 1  # the complete lines
    assert events.name == f"events-{0:015d}-{end:015d}.parquet"
    assert _read(events).num_rows == 3
    marker = json.loads((store / convert.MARKER).read_text())
    assert marker["converted_by"] == "trainmon convert" and "rank0/grad_reduced_3.csv" in marker["files"]


def test_query_and_analyse_work_after_convert(csv_run, capsys):
    assert main(["convert", str(csv_run)]) == 0
    con = open_run(csv_run)
    assert con.execute("SELECT count(*) FROM anomalies").fetchall() == [(3,)]  # the cut line is not an event
    assert con.execute("SELECT count(DISTINCT rank) FROM grad_reduced").fetchall() == [(2,)]
    sql = dict(con.execute("SELECT view_name, sql FROM duckdb_views() WHERE NOT internal").fetchall())
    assert "union_by_name = false" in sql["scalars"]  # the parts' schema is marked, as the sink marks it
    assert "union_by_name = true" in sql["grad_reduced"]  # rank 0's metrics change mid-run: by name
    con.close()
    capsys.readouterr()
    assert main(["query", str(csv_run), "SELECT rank, count(*) AS n FROM actv GROUP BY rank ORDER BY rank",
                 "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ["rank,n", "0,72", "1,72"]
    assert main(["analyse", str(csv_run)]) == 0
    out = capsys.readouterr().out
    assert "from the store (SQL)" in out and "first non-finite row: step 0" in out
    analysed = json.loads((csv_run / "anomaly_analyse.json").read_text())
    assert analysed["events"] == 3 and analysed["spread"]


def test_big_files_are_read_and_written_in_blocks(csv_run, monkeypatch):
    """Blocks of a few rows: the order counter goes on across blocks, the parts hold the rows in order."""
    reference = csv_run.parent / "whole"
    shutil.copytree(csv_run, reference)
    assert main(["convert", str(reference)]) == 0
    monkeypatch.setattr(readers, "_CHUNK", 200)
    monkeypatch.setattr(convert, "PART_ROWS", 7)
    assert main(["convert", str(csv_run)]) == 0
    blocks = _parts(csv_run / "store", "actv", 1)
    assert len(blocks) >= 5
    whole = _read(_parts(reference / "store", "actv", 1)[0])
    joined = [_read(p) for p in blocks]
    for column in whole.column_names:
        if whole.schema.field(column).type == "double":
            assert _bits(np.concatenate([t.column(column).to_numpy() for t in joined])) == _bits(whole.column(column))
        else:
            assert sum((t.column(column).to_pylist() for t in joined), []) == whole.column(column).to_pylist()


def test_a_big_anomalies_file_is_stored_a_block_at_a_time(csv_run, monkeypatch):
    lines = (csv_run / "rank0" / "anomalies.jsonl").read_bytes()
    monkeypatch.setattr(convert, "EVENT_BYTES", 100)
    assert main(["convert", str(csv_run)]) == 0
    stored = sorted((csv_run / "store" / "anomalies" / "rank=0").iterdir())
    ranges = [tuple(int(n) for n in p.stem.split("-")[1:]) for p in stored]
    assert len(stored) == 3 and ranges[0][0] == 0 and ranges[-1][1] == lines.rfind(b"\n") + 1
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous byte ranges, each of whole lines
    con = open_run(csv_run)
    assert con.execute("SELECT count(*), count(DISTINCT seq) FROM anomalies").fetchall() == [(3, 3)]
    con.close()


def _msprobe_reference(folder: Path) -> dict[tuple[str, str, int, int, str], float]:
    """``(family, name, step, micro-step, metric) -> value`` of msprobe's CSV files, read with the csv module."""
    values = {}
    for path in sorted(folder.glob("*-rank*-*/*.csv")):
        family = path.name.rsplit("_", 1)[0]
        header, rows = _csv_rows(path)
        for row in rows:
            columns = dict(zip(header, row))
            micro = int(columns.get("micro_step", columns.get("module_name", "_0").rsplit("_", 1)[-1] or 0))
            for name, metric, text, step in msprobe_rows(header, row, family):
                values[family, name, int(step), micro, metric] = float(text)
    return values


@pytest.mark.parametrize("version", ["msprobe-1.2.1", "msprobe-26.2.0"])
def test_msprobe_output_round_trips(tmp_path, capsys, version):
    folder = tmp_path / version
    shutil.copytree(DATA / version, folder)
    assert main(["convert", str(folder)]) == 0
    assert "msprobe CSV files of 1 rank" in capsys.readouterr().out
    con = open_run(folder)
    got = {}
    tables = [t for (t,) in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()
              if t not in ("anomalies", "scalars")]
    for table in tables:
        columns = [c for c, *_ in con.execute(f'DESCRIBE "{table}"').fetchall()]
        metrics = columns[8:-1]  # then rank, from the partition
        assert columns[-1] == "rank" and columns[:8] == ["step", "micro_step", "vpp_stage", "pp_stage", "order",
                                                         "phase", "name", "nonfinite"]
        for row in con.execute(f'SELECT name, step, micro_step, {", ".join(metrics)} FROM "{table}"').fetchall():
            for metric, value in zip(metrics, row[3:]):
                if value is not None:
                    got[table, row[0], row[1], row[2], metric] = value
    con.close()
    want = _msprobe_reference(folder)
    assert got.keys() == want.keys() and len(got) > 50
    assert all(_bits([got[k]]) == _bits([want[k]]) for k in want)
    assert main(["analyse", str(folder)]) == 0  # msprobe's events as before, and the rows of the store
    out = capsys.readouterr().out
    assert "read msprobe's anomaly events" in out and "first non-finite row" in out
    written = json.loads((folder / "trainmon_anomaly_analyse.json").read_text())
    assert written["spread"] == [] and written["nonfinite_rows"]["rows"] >= 0


def _one_line_exit_2(argv: list[str], capsys, *words: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and err.startswith("trainmon convert: error:"), err
    for word in words:
        assert word in err, err
    return err


def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path, capsys):
    _one_line_exit_2(["convert", str(tmp_path / "missing")], capsys, "does not exist")
    (tmp_path / "file").write_text("x")
    _one_line_exit_2(["convert", str(tmp_path / "file")], capsys, "is not a directory")
    (tmp_path / "empty").mkdir()
    _one_line_exit_2(["convert", str(tmp_path / "empty")], capsys, "holds no CSV files")
    run = write_csv_run(tmp_path / "out" / "run")
    _one_line_exit_2(["convert", str(tmp_path / "out")], capsys, "folder of 1 runs", "trainmon convert")
    _one_line_exit_2(["convert", str(run / "rank1")], capsys, "one rank folder")
    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    with open(broken / "rank1" / "grad_reduced.csv", "a") as handle:
        handle.write("0,x,5\n")
    _one_line_exit_2(["convert", str(broken)], capsys, "grad_reduced.csv:", "fields")
    assert sorted(p.name for p in broken.iterdir()) == ["rank0", "rank1"]  # no store, no hidden folder
    assert main(["convert", str(run)]) == 0
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    _one_line_exit_2(["convert", str(run)], capsys, "already exists")
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    msprobe = tmp_path / "msprobe"
    shutil.copytree(DATA / "msprobe-26.2.0", msprobe)
    target = next(msprobe.glob("*-rank0-*")) / "grad_reduced_0-0.csv"
    target.write_text(target.read_text().replace("0.0,0,[]", "zero,0,[]", 1).replace(",0.0,0,", ",x,0,", 1))
    _one_line_exit_2(["convert", str(msprobe)], capsys, "grad_reduced_0-0.csv:")
    assert not (msprobe / "store").exists() and not list(msprobe.glob(".store*"))
