"""The Parquet sink's files: rolled on the clock, merged atomically, superseded parts skipped and repaired,
no symlink followed; the store's layout helpers."""

from __future__ import annotations

import itertools
import json
import math
import shutil
import weakref
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainmon.base.records import Row, RowKey, StepRecord
from trainmon.base.safe_io import UnsafePathError
from trainmon.sinks import SinkWriter, build_sinks
from trainmon.sinks.parquet import ParquetSink
from trainmon.sinks.store_layout import live_parts, part_name
from trainmon.sinks.store_parts import TableParts
from trainmon.tools.store import open_run, table_sources


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(step: int, metrics: tuple[str, ...] = ("norm", "max"), rank: int = 0) -> StepRecord:
    rows = [Row(RowKey("grad_reduced", f"layer{i}.weight", order=i), step,
                {m: step + i / 3 for m in metrics}, False) for i in range(3)]
    rows.append(Row(RowKey("actv", "layer0.output"), step, {m: math.nan for m in metrics}, True))
    return StepRecord(step=step, rank=rank, rows=rows, scalars={"loss": 1.0 / (step + 1)})


def read(path: Path) -> pq.Table:
    with open(path, "rb") as handle:  # a path would leave pyarrow's own handle open until collected
        return pq.read_table(handle)


def files(run: Path, table: str = "grad_reduced", rank: int = 0) -> list[Path]:
    return sorted((run / "store" / table / f"rank={rank}").glob("*.parquet"))


def test_rows_roll_on_the_clock_and_merge_at_close(tmp_path):
    clock = Clock()
    sink = ParquetSink(tmp_path / "rank0", clock=clock, roll_seconds=2.0, fan_in=64)
    for step in range(3):
        sink.write(record(step))
        sink.flush()
    assert files(tmp_path) == []  # within roll_seconds: in memory only
    clock.now = 2.5
    sink.flush()
    assert len(files(tmp_path)) == 1 and len(files(tmp_path, "scalars")) == 1
    for step in range(3, 5):
        sink.write(record(step))
    sink.close()
    (merged,) = files(tmp_path)  # the two small files became one part
    assert merged.name.startswith("part-000000000-000000004-")
    table = read(merged)
    assert table.column("step").to_pylist() == [s for s in range(5) for _ in range(3)]
    assert table.schema.field("norm").type == "double" and table.schema.field("step").type == "int64"
    actv = read(files(tmp_path, "actv")[0])
    assert actv.column("nonfinite").to_pylist() == [True] * 5 and math.isnan(actv.column("max")[0].as_py())


def test_fan_in_merges_runs_of_small_files(tmp_path):
    clock = Clock()
    sink = ParquetSink(tmp_path / "rank0", clock=clock, roll_seconds=1.0, fan_in=3)
    for step in range(7):
        sink.write(record(step))
        clock.now += 1.0
        sink.flush()
    parts = live_parts(files(tmp_path))  # steps 0-2 and 3-5 merged (sequence numbers count every table's files)
    assert [(p.first_step, p.last_step, p.lo < p.hi) for p in parts] == [(0, 2, True), (3, 5, True), (6, 6, False)]
    sink.close()
    con = open_run(tmp_path)
    assert con.execute("SELECT count(*), count(DISTINCT step) FROM grad_reduced").fetchall() == [(21, 7)]


def test_superseded_parts_are_skipped_and_repaired(tmp_path):
    sink = ParquetSink(tmp_path / "rank0", roll_seconds=0.0, fan_in=64)
    for step in range(2):
        sink.write(record(step))
        sink.flush()
    small = files(tmp_path)
    kept = [tmp_path / p.name for p in small]
    for path in small:
        shutil.copy(path, tmp_path / path.name)
    sink.close()
    for path in kept:  # a crash between the merge's rename and the removal of its inputs
        shutil.copy(path, files(tmp_path)[0].parent / path.name)
    foreign = files(tmp_path)[0].parent / "notes.parquet"
    foreign.write_bytes(b"not ours")
    assert len(live_parts(files(tmp_path))) == 1
    assert open_run(tmp_path).execute("SELECT count(*) FROM grad_reduced").fetchall() == [(6,)]
    resumed = ParquetSink(tmp_path / "rank0", roll_seconds=0.0)
    resumed.write(record(2))
    resumed.close()  # its first roll into the folder removed the superseded parts, and only those
    assert len(files(tmp_path)) == 3 and foreign.exists()
    assert open_run(tmp_path).execute("SELECT count(*) FROM grad_reduced").fetchall() == [(9,)]


def test_changed_metrics_go_to_a_file_of_their_own(tmp_path):
    sink = ParquetSink(tmp_path / "rank0")
    sink.write(record(0, ("norm", "max")))
    sink.write(record(1, ("norm", "min", "mean")))
    sink.close()
    rows = open_run(tmp_path).execute("SELECT step, norm, max, min FROM grad_reduced WHERE name = 'layer0.weight' "
                                      "ORDER BY step").fetchall()
    assert rows == [(0, 0.0, 0.0, None), (1, 1.0, None, 1.0)]


def test_symlinks_in_the_store_are_not_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    run = tmp_path / "run"
    (run / "store" / "grad_reduced").mkdir(parents=True)
    (run / "store" / "grad_reduced" / "rank=0").symlink_to(outside)
    sink = ParquetSink(run / "rank0")
    sink.write(record(0))
    with pytest.raises(UnsafePathError):
        sink.close()
    assert list(outside.iterdir()) == []


def test_lifecycle_through_the_writer(tmp_path):
    (sink,) = build_sinks(["parquet"], tmp_path / "rank1")
    writer = SinkWriter([sink])
    for step in range(4):
        writer.submit(record(step, rank=1))
    writer.close()
    writer.close()
    assert writer.stats()["parquet"]["written"] == 4
    con = open_run(tmp_path)
    assert con.execute("SELECT DISTINCT rank FROM scalars").fetchall() == [(1,)]
    assert con.execute("SELECT count(*) FROM scalars").fetchall() == [(4,)]


def test_part_names_sort_by_step():
    names = [part_name(first, first + 9, "ab", seq, seq) for seq, first in enumerate((0, 10, 100, 1000))]
    assert sorted(names) == names
    assert [p.first_step for p in live_parts([Path(n) for n in reversed(names)])] == [0, 10, 100, 1000]


def _event_line(step: int, value: object = 1.5) -> str:
    event = {"step": step, "micro_step": 0, "rank": 0, "phase": "forward", "pp_stage": 0, "vpp_stage": 0, "order": 3,
             "detector": "nonfinite", "family": "actv", "name": "fc.output", "metric": "nans", "value": value,
             "baseline": 0.0, "message": "m", "time": "t"}
    return json.dumps(event, separators=(",", ":")) + "\n"


def test_anomaly_events_stored_once_across_resumes(tmp_path):
    jsonl = tmp_path / "rank0" / "anomalies.jsonl"
    jsonl.parent.mkdir()
    jsonl.write_text(_event_line(0, "nan") + "not json\n" + _event_line(1, "-inf"))
    sink = ParquetSink(tmp_path / "rank0")
    sink.write(record(0))
    sink.close()
    with jsonl.open("a") as handle:  # a resumed run appends; its last line is still being written
        handle.write(_event_line(2) + _event_line(3)[:40])
    resumed = ParquetSink(tmp_path / "rank0")
    resumed.write(record(2))
    resumed.close()
    stored = sorted((tmp_path / "store" / "anomalies" / "rank=0").iterdir())
    assert "rank" not in read(stored[0]).column_names  # the partition's (Spark refuses a column that is both)
    assert len(stored) == 2 and stored[1].name.startswith(f"events-{stored[0].name.split('-')[2].split('.')[0]}")
    with jsonl.open("a") as handle:  # the end of that line, and one more: read from the file by the reader
        handle.write(_event_line(3)[40:] + _event_line(4))
    rows = open_run(tmp_path).execute("SELECT step, rank, value FROM anomalies ORDER BY step").fetchall()
    assert [(s, r) for s, r, _ in rows] == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0)]
    assert math.isnan(rows[0][2]) and rows[1][2] == -math.inf and rows[2][2] == 1.5


def test_no_events_gives_an_empty_anomalies_table(tmp_path):
    sink = ParquetSink(tmp_path / "rank0")
    sink.write(record(0))
    sink.close()
    con = open_run(tmp_path)
    assert con.execute("SELECT count(*) FROM anomalies").fetchall() == [(0,)]
    assert "rank" in [name for name, *_ in con.execute("DESCRIBE anomalies").fetchall()]


def test_a_part_never_replaces_an_existing_file(tmp_path):
    from trainmon.base.safe_io import write_atomic

    target = tmp_path / "run" / "part.parquet"
    write_atomic(target, b"first", root=tmp_path / "run", exclusive=True)
    with pytest.raises(FileExistsError):
        write_atomic(target, b"second", root=tmp_path / "run", exclusive=True)
    assert target.read_bytes() == b"first" and [p.name for p in target.parent.iterdir()] == ["part.parquet"]


def test_merge_rows_bounds_a_merge(tmp_path):
    sink = ParquetSink(tmp_path / "rank0", roll_seconds=0.0, fan_in=64, merge_rows=6)
    for step in range(4):
        sink.write(record(step))
        sink.flush()
    parts = live_parts(files(tmp_path))  # 3 rows per step: steps 0-1 and 2-3 merged at 6 rows each
    assert [(p.first_step, p.last_step) for p in parts] == [(0, 1), (2, 3)]
    sink.close()


def test_rows_are_written_once_training_pauses(tmp_path):
    """A pause (an evaluation, a checkpoint) longer than flush_seconds writes what is in memory: a kill -9
    during it loses nothing."""
    import time

    sink = ParquetSink(tmp_path / "rank0", roll_seconds=3600.0)
    writer = SinkWriter([sink], flush_seconds=0.1)
    writer.submit(record(0))
    deadline = time.monotonic() + 10
    while not files(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(files(tmp_path)) == 1
    writer.close()


# --------------------------------------------------------------------------- merge levels
def _step_table(step: int, rows: int = 5, metrics: tuple[str, ...] = ("norm",)) -> pa.Table:
    columns = {"step": pa.array([step] * rows, pa.int64()), "name": pa.array([f"t{i}" for i in range(rows)]),
               "nonfinite": pa.array([step % 97 == 0] * rows)}
    for j, metric in enumerate(metrics):
        columns[metric] = pa.array([step * 1000.0 + i + j / 7 for i in range(rows)], pa.float64())
    return pa.table(columns)


def _parts_of(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.parquet"))


def test_level_merges_bound_the_file_count_and_keep_every_row(tmp_path):
    """fan_in 4, level_fan_in 3: 1,000 steps of a small part each leave at most 3 small parts and 2 parts per
    level (instead of 250 merged parts), and every row is there once, in step order, bit for bit."""
    folder = tmp_path / "store" / "t" / "rank=0"
    parts = TableParts(folder, tmp_path, "ab", itertools.count().__next__, fan_in=4, level_fan_in=3,
                       row_group_rows=40)
    most = 0
    for step in range(1000):
        parts.add(_step_table(step), step, step)
        most = max(most, len(_parts_of(folder)))
    parts.close()
    levels = math.ceil(math.log(1000 / 4, 3))  # 250 parts of level 1 -> 6 levels above the small parts
    assert most <= 3 + 2 * levels + 1, most
    final = live_parts(_parts_of(folder))
    assert [p.path for p in final] == _parts_of(folder)  # nothing superseded left behind
    assert len(final) <= 2 * levels + 1
    table = pa.concat_tables([read(p.path) for p in final])
    expected = pa.concat_tables([_step_table(step) for step in range(1000)])
    assert table.equals(expected)
    with open(final[0].path, "rb") as handle:
        meta = pq.ParquetFile(handle).metadata
    assert meta.num_row_groups == -(-meta.num_rows // 40)  # streamed: row groups of 40 rows (the last fewer)
    for index in range(meta.num_row_groups - 1):
        stats = meta.row_group(index).column(0).statistics  # step statistics: 8 steps each
        assert meta.row_group(index).num_rows == 40 and stats.has_min_max and stats.max - stats.min == 7


def test_a_streamed_merge_reads_one_row_group_at_a_time(tmp_path, monkeypatch):
    """A merge of merged parts never reads a part whole: only ParquetFile.read_row_group, one at a time (each
    table it returns is let go before the next is read), and it writes row groups as they fill."""
    folder = tmp_path / "store" / "t" / "rank=0"
    parts = TableParts(folder, tmp_path, "ab", itertools.count().__next__, fan_in=2, level_fan_in=2,
                       row_group_rows=10)
    for step in range(4):
        parts.add(_step_table(step), step, step)
    assert len(_parts_of(folder)) == 1  # 0-1 and 2-3 merged (level 1), then those two (level 2)
    live: list[int] = []
    most = [0]
    original = pq.ParquetFile.read_row_group

    def read_row_group(self: pq.ParquetFile, index: int, *args: object, **kwargs: object) -> pa.Table:
        table = original(self, index, *args, **kwargs)
        live.append(table.num_rows)
        weakref.finalize(table, live.pop)
        most[0] = max(most[0], len(live))
        return table

    original_read = pq.ParquetFile.read

    def read_whole(self: pq.ParquetFile, *args: object, **kwargs: object) -> pa.Table:
        assert self.metadata.num_rows == 5, "a merged part read whole"  # only small parts (5 rows) are
        return original_read(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", read_row_group)
    monkeypatch.setattr(pq.ParquetFile, "read", read_whole)
    for step in range(4, 8):
        parts.add(_step_table(step), step, step)
    (merged,) = _parts_of(folder)
    assert most[0] == 1
    monkeypatch.undo()
    table = read(merged)
    assert table.column("step").to_pylist() == [s for s in range(8) for _ in range(5)]
    with open(merged, "rb") as handle:
        assert pq.ParquetFile(handle).metadata.num_row_groups == 4  # 40 rows in row groups of 10


def test_kill_during_a_level_merge_leaves_no_duplicate(tmp_path):
    """A crash after a level merge's part is renamed into place and before its inputs are gone: live_parts skips
    the inputs (nested sequence ranges: a part of level 2 covers parts of level 1), the next writer removes them."""
    folder = tmp_path / "store" / "t" / "rank=0"
    parts = TableParts(folder, tmp_path, "ab", itertools.count().__next__, fan_in=2, level_fan_in=2)
    for step in range(2):
        parts.add(_step_table(step), step, step)
    (level1,) = _parts_of(folder)
    saved = [(p.name, p.read_bytes()) for p in [level1]]
    for step in range(2, 4):
        parts.add(_step_table(step), step, step)
    (level2,) = _parts_of(folder)
    for name, data in saved:  # the input of level 2 left behind, as a kill between rename and removal leaves it
        (folder / name).write_bytes(data)
    (folder / part_name(2, 2, "ab", 2, 2)).write_bytes(read_bytes_of(_step_table(2)))  # a small one inside too
    assert [p.path for p in live_parts(_parts_of(folder))] == [level2]
    assert open_run(tmp_path).execute("SELECT count(*), count(DISTINCT step) FROM t").fetchall() == [(20, 4)]
    resumed = TableParts(folder, tmp_path, "cd", itertools.count().__next__)
    resumed.add(_step_table(4), 4, 4)
    assert [p.name for p in _parts_of(folder)] == [level2.name, part_name(4, 4, "cd", 0, 0)]


def read_bytes_of(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return bytes(sink.getvalue())


def test_mixed_schemas_are_read_by_name(tmp_path):
    """One writer's parts of one schema: the view reads them without union_by_name; a resumed run with another
    metric, or a folder without the schema marks (an older run), is read with it: every column is there."""
    sink = ParquetSink(tmp_path / "rank0", roll_seconds=0.0)
    for step in range(3):
        sink.write(record(step, ("norm", "max")))
        sink.flush()
    sink.close()
    sources = table_sources(tmp_path)
    assert sources["grad_reduced"][1] and sources["scalars"][1]
    assert "union_by_name = false" in _view_sql(tmp_path, "grad_reduced")
    resumed = ParquetSink(tmp_path / "rank0", roll_seconds=0.0)
    for step in range(3, 5):
        resumed.write(record(step, ("norm", "min")))  # other metrics: min instead of max
        resumed.flush()
    resumed.close()
    assert not table_sources(tmp_path)["grad_reduced"][1]
    assert table_sources(tmp_path)["scalars"][1]  # same columns in both writers
    con = open_run(tmp_path)
    rows = con.execute("SELECT step, norm, max, min FROM grad_reduced WHERE name = 'layer1.weight' "
                       "ORDER BY step").fetchall()
    third = 1 / 3
    assert rows == [(s, s + third, s + third if s < 3 else None, None if s < 3 else s + third) for s in range(5)]
    folder = files(tmp_path, "scalars")[0].parent
    for mark in folder.glob("_schema-*"):
        mark.unlink()  # as an older run has none
    assert not table_sources(tmp_path)["scalars"][1]
    assert open_run(tmp_path).execute("SELECT count(*) FROM scalars").fetchall() == [(5,)]


def test_a_writer_whose_metrics_change_marks_both_schemas(tmp_path):
    """A writer's schema is not fixed (a table's metrics may change within a run): it marks each schema it writes,
    and its merges hold the union of the columns."""
    sink = ParquetSink(tmp_path / "rank0", roll_seconds=0.0, fan_in=3)
    for step in range(4):
        sink.write(record(step, ("norm", "max") if step < 2 else ("norm",)))
        sink.flush()
    sink.close()
    assert len(list(files(tmp_path)[0].parent.glob("_schema-*"))) == 2
    assert not table_sources(tmp_path)["grad_reduced"][1]
    con = open_run(tmp_path)
    assert con.execute("SELECT count(*), count(max) FROM grad_reduced").fetchall() == [(12, 6)]


def _view_sql(run: Path, view: str) -> str:
    con = open_run(run)
    return str(con.execute("SELECT sql FROM duckdb_views() WHERE view_name = ?", [view]).fetchall()[0][0])


def test_tools_give_the_same_answers_over_merge_levels(tmp_path, capsys):
    """The same records written with one merge at close and with merges of merges at every other file (fan-ins of
    2: four levels): query, analyse and report give the same answers from both."""
    import re

    from trainmon.tools.cli import main

    runs = {}
    for label, fans in (("flat", {}), ("levels", {"fan_in": 2, "level_fan_in": 2})):
        run = runs[label] = tmp_path / label / "run"
        for rank in range(2):
            sink = ParquetSink(run / f"rank{rank}", roll_seconds=0.0, **fans)
            for step in range(20):
                sink.write(record(step, ("norm", "max", "nans"), rank=rank))
                sink.flush()
            sink.close()
    parts = {label: len(list((run / "store" / "grad_reduced").rglob("*.parquet"))) for label, run in runs.items()}
    assert parts == {"flat": 2, "levels": 2 * 2}  # a rank's 20 files: parts of 16 (level 4) and 4 (level 2)

    def answers(run: Path) -> tuple[str, str, dict, str]:
        capsys.readouterr()
        assert main(["query", str(run), "SELECT * FROM grad_reduced ORDER BY rank, step, \"order\"",
                     "--format", "csv"]) == 0
        rows = capsys.readouterr().out
        assert main(["query", str(run), "SELECT * FROM actv ORDER BY rank, step", "--format", "csv"]) == 0
        actv = capsys.readouterr().out
        assert main(["analyse", str(run), "-o", str(run.parent / "a.json")]) == 0
        analysed = json.loads((run.parent / "a.json").read_text())
        analysed.pop("run_dir", None)
        assert main(["report", str(run), "-o", str(run.parent / "r.html")]) == 0
        page = re.search(r'<script id="report-data" type="application/json">(.*?)</script>',
                         (run.parent / "r.html").read_text(), re.S)
        assert page is not None
        data = json.loads(page.group(1))
        for key in ("run_dir", "run_name", "generated"):
            data["summary"].pop(key)
        return rows, actv, analysed, json.dumps(data, sort_keys=True)

    flat, levels = answers(runs["flat"]), answers(runs["levels"])
    assert flat[0].count("\n") == 2 * 20 * 3 + 1 and flat[2]["first_nonfinite_row"]["step"] == 0 and flat[2]["spread"]
    assert flat == levels


def test_a_failed_level_merge_stops_merging_and_loses_nothing(tmp_path, monkeypatch):
    """A merge of merged parts that fails (a full disk) raises to the sink's caller and stops this writer's merges for
    good: its inputs stay where they are, and no later merge's sequence range can cover them (readers would take
    them for merged and skip them). Every row is read back once."""
    import trainmon.sinks.store_parts as store_parts

    folder = tmp_path / "store" / "t" / "rank=0"
    parts = TableParts(folder, tmp_path, "ab", itertools.count().__next__, fan_in=2, level_fan_in=2)
    for step in range(2):
        parts.add(_step_table(step), step, step)
    original = store_parts.atomic_output

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_parts, "atomic_output", full)
    parts.add(_step_table(2), 2, 2)
    with pytest.raises(OSError, match="No space"):
        parts.add(_step_table(3), 3, 3)  # 2-3 merged (level 1), then 0-1 and 2-3 fail to merge (level 2)
    monkeypatch.setattr(store_parts, "atomic_output", original)
    for step in range(4, 12):
        parts.add(_step_table(step), step, step)
    parts.close()
    names = [p.name for p in _parts_of(folder)]
    assert len(names) == 2 + 8 and names[:2] == [part_name(0, 1, "ab", 0, 1), part_name(2, 3, "ab", 2, 3)]
    assert len(live_parts(_parts_of(folder))) == 10
    con = open_run(tmp_path)
    assert con.execute("SELECT count(*), count(DISTINCT step) FROM t").fetchall() == [(60, 12)]
