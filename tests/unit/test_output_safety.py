"""Nothing lost, nothing leaks into training: resume, full disk, slow and stuck outputs, symlinks.

Framework-free: every output is driven with hand-made records and read back from the real files.
A full disk is a real 1 MiB tmpfs where this machine lets us mount one (root on Linux), else skipped.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.responses import JsonlAction
from trainmon.base.records import Row, RowKey, StepRecord
from trainmon.base.safe_io import UnsafePathError, make_dirs, open_output, write_atomic, write_json
from trainmon.base.threads import OutputThread
from trainmon.config import ConfigError, load_config
from trainmon.sinks.base import SinkWriter
from trainmon.sinks.csv import CsvSink, open_csv_table
from trainmon.sinks.tensorboard import TensorBoardSink


def _record(step: int, metrics: tuple[str, ...] = ("norm", "nans"), width: int = 1) -> StepRecord:
    rows = [Row(RowKey("grad_reduced", f"layer{i}.weight", 0, 0, i), step,
                {m: float(step + i) for m in metrics}, False) for i in range(width)]
    return StepRecord(step=step, rank=0, rows=rows, scalars={"loss": 1.0 / (step + 1)}, pp_stage=0)


def _event(step: int) -> AnomalyEvent:
    return AnomalyEvent(step, 0, 0, "loss", "scalars", "loss", "value", math.nan, 0.0, "nonfinite", f"nan at {step}",
                        0, 0, 0, "2026-01-01T00:00:00.000Z")


def _messages(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _write_all(sinks, records) -> None:
    writer = SinkWriter(sinks, flush_seconds=0.05)
    for record in records:
        writer.submit(record)
    writer.close()


# ------------------------------------------------------------------ resume: append, never truncate
def test_resume_with_the_same_header_appends_and_another_header_starts_a_new_file(tmp_path, caplog):
    rank_dir = tmp_path / "run" / "rank0"
    _write_all([CsvSink(rank_dir)], [_record(s) for s in range(3)])
    first = (rank_dir / "grad_reduced.csv").read_bytes()
    _write_all([CsvSink(rank_dir)], [_record(s) for s in range(3, 5)])  # resumed, same config
    table = pd.read_csv(rank_dir / "grad_reduced.csv")
    assert table.step.tolist() == [0, 1, 2, 3, 4]  # one header, rows of both runs
    assert (rank_dir / "grad_reduced.csv").read_bytes().startswith(first)
    assert pd.read_csv(rank_dir / "scalars.csv").step.tolist() == [0, 1, 2, 3, 4]
    before = (rank_dir / "grad_reduced.csv").read_bytes()
    _write_all([CsvSink(rank_dir)], [_record(s, ("max",)) for s in (5, 6)])  # resumed with other metrics
    assert (rank_dir / "grad_reduced.csv").read_bytes() == before  # left exactly as it was
    moved = pd.read_csv(rank_dir / "grad_reduced_5.csv")
    assert list(moved.columns) == ["vpp_stage", "name", "step", "micro_step", "max"] and moved.step.tolist() == [5, 6]
    assert pd.read_csv(rank_dir / "scalars.csv").step.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert len(_messages(caplog, "other columns")) == 1
    # A third layout at the same step does not touch grad_reduced_5.csv either: next free number.
    _write_all([CsvSink(rank_dir)], [_record(5, ("min",))])
    assert pd.read_csv(rank_dir / "grad_reduced_6.csv").columns[-1] == "min"
    assert pd.read_csv(rank_dir / "grad_reduced_5.csv").step.tolist() == [5, 6]


def test_a_row_cut_by_a_crash_is_ended_before_appending_and_the_header_is_flushed_at_once(tmp_path):
    path = tmp_path / "rank0" / "scalars.csv"
    path.parent.mkdir()
    path.write_text("step,name,value\n0,loss,1.0\n1,lo")  # killed in the middle of a row
    handle, used = open_csv_table(path.parent, "scalars", ["step", "name", "value"], 2, tmp_path)
    csv.writer(handle).writerow([2, "loss", "0.5"])
    handle.close()
    assert used == path and path.read_text().splitlines() == ["step,name,value", "0,loss,1.0", "1,lo", "2,loss,0.5"]
    # A new file: the header is in the file (not in a buffer) as soon as it is opened.
    handle, fresh = open_csv_table(path.parent, "actv", ["vpp_stage", "name"], 0, tmp_path)
    try:
        assert fresh.read_bytes() == b"vpp_stage,name\r\n"
    finally:
        handle.close()


def test_flush_seconds_must_be_positive_and_at_most_timeout_max():
    for bad in (0, -1.0, threading.TIMEOUT_MAX * 2):
        with pytest.raises(ConfigError) as info:
            load_config({"flush_seconds": bad})
        assert info.value.key == "flush_seconds"
    assert load_config({"flush_seconds": 0.5}).flush_seconds == 0.5


# ------------------------------------------------------------------ flush policy
def test_rows_are_flushed_as_soon_as_the_writer_is_idle(tmp_path):
    rank_dir = tmp_path / "run" / "rank0"
    writer = SinkWriter([CsvSink(rank_dir)], flush_seconds=3600)  # the timer can never be what flushes
    try:
        for step in range(3):
            writer.submit(_record(step))
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                if (rank_dir / "scalars.csv").exists() and f"\n{step}," in (rank_dir / "scalars.csv").read_text():
                    break
                time.sleep(0.005)
            assert pd.read_csv(rank_dir / "scalars.csv").step.tolist() == list(range(step + 1))
    finally:
        writer.close()


def test_a_busy_writer_still_flushes_every_flush_seconds(tmp_path):
    flushed_at: list[float] = []

    def write(item: int) -> None:
        time.sleep(0.01)

    output = OutputThread("busy", write, lambda: flushed_at.append(time.monotonic()), flush_seconds=0.1,
                          max_pending=10_000)
    start = time.monotonic()
    for i in range(60):  # 0.6 s of writes queued at once: the queue is never empty until the end
        output.submit(i)
    output.close()
    gaps = [b - a for a, b in zip([start, *flushed_at], flushed_at)]
    assert len(flushed_at) >= 4 and max(gaps[:-1]) < 1.0, gaps  # ~0.11 s; slack for a loaded machine


# ------------------------------------------------------------------ full disk
def test_full_disk_warns_once_per_output_counts_what_it_lost_and_keeps_what_was_written(tmpfs_1m, caplog):
    rank_dir = tmpfs_1m / "run" / "rank0"
    jsonl = JsonlAction(rank_dir / "anomalies.jsonl")
    writer = SinkWriter([CsvSink(rank_dir), TensorBoardSink(rank_dir)], flush_seconds=0.05, max_pending=10_000)
    for step in range(300):  # ~26 KiB of CSV and events per step: the disk is full after about 40 steps
        writer.submit(_record(step, width=200))  # never raises
    writer.close()
    # then the anomaly log, on the disk the sinks filled (its lines are small: written alongside the sinks,
    # all 300 could reach the disk before it fills, depending on the threads' scheduling)
    for step in range(300):
        jsonl([_event(step)])
    jsonl.close()
    for name in ("csv", "tensorboard", "anomalies.jsonl"):
        assert len(_messages(caplog, f"output {name} failed and is disabled (OSError: [Errno 28]")) == 1, name
        (lost,) = _messages(caplog, f"output {name} did not write")
        assert " of 300 records" in lost
    # What reached the disk before it filled is there: whole rows of the first steps (a last row may be cut).
    with open(rank_dir / "grad_reduced.csv", newline="") as handle:
        rows = [row for row in csv.reader(handle) if len(row) == 6][1:]
    steps = sorted({int(row[2]) for row in rows})
    assert steps == list(range(len(steps))) and len(steps) >= 10
    stats = writer.stats()
    for name, counts in stats.items():
        assert counts["written"] + counts["dropped"] == 300, name
    # the CSV sink counts as written only what reached its file (each output has its own thread, so
    # which one fills the disk first, and how many records the others wrote, depends on scheduling)
    assert stats["csv"]["written"] <= len(steps) + 1


# ------------------------------------------------------------------ slow, stuck and dead outputs
class _SlowSink:
    name = "slow"

    def __init__(self, delay: float) -> None:
        self.delay, self.steps = delay, []

    def write(self, record: StepRecord) -> None:
        time.sleep(self.delay)
        self.steps.append(record.step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_slow_sink_drops_only_its_own_rows_and_says_how_many(tmp_path, caplog):
    rank_dir = tmp_path / "run" / "rank0"
    release = threading.Event()

    class Stalled(_SlowSink):
        name = "slow"

        def write(self, record: StepRecord) -> None:
            release.wait(10)  # a disk that takes no record while training runs
            self.steps.append(record.step)

    slow = Stalled(0)
    writer = SinkWriter([CsvSink(rank_dir), slow], flush_seconds=2.0,
                        stats_path=tmp_path / "run" / "rank0" / "writer_stats.json", root=tmp_path / "run")
    for step in range(150):
        writer.submit(_record(step))
        time.sleep(0.002)  # a training step; the CSV writer keeps up, the slow one cannot
    release.set()
    writer.close()
    assert pd.read_csv(rank_dir / "grad_reduced.csv").step.tolist() == list(range(150))  # CSV lost nothing
    stats = json.loads((rank_dir / "writer_stats.json").read_text())
    assert stats["csv"]["dropped"] == 0 and stats["csv"]["written"] == 150
    assert stats["slow"]["written"] == len(slow.steps) == 65  # the one it was stuck in + 64 queued
    assert stats["slow"]["dropped"] == stats["slow"]["dropped_slow"] == 85
    (report,) = _messages(caplog, "output slow did not write")
    assert "did not write 85 of 150 records (85 dropped while it lagged behind training" in report
    assert len(_messages(caplog, "output slow is slower than training")) == 1
    assert not _messages(caplog, "output csv")


def test_close_is_bounded_when_a_sink_is_stuck_and_never_raises(caplog):
    entered, release = threading.Event(), threading.Event()

    class Stuck(_SlowSink):
        name = "stuck"

        def write(self, record: StepRecord) -> None:
            entered.set()
            release.wait(30)

    writer = SinkWriter([Stuck(0)], max_pending=4, close_timeout=0.3)
    try:
        writer.submit(_record(0))
        assert entered.wait(5)  # the thread is stuck in step 0: 4 more are queued, 5 dropped
        for step in range(1, 10):
            writer.submit(_record(step))
        start = time.monotonic()
        writer.close()
        assert time.monotonic() - start < 2.0  # 0.3 s and a loaded machine's slack; not 30 s
        writer.close()  # idempotent
    finally:
        release.set()  # the abandoned thread wakes up, skips what is queued and ends
    assert len(_messages(caplog, "output stuck did not finish writing within 0.3 s")) == 1
    (report,) = _messages(caplog, "output stuck did not write")
    assert "did not write 9 of 10 records (5 dropped while it lagged behind training, 0 lost to its failure, " \
           "4 abandoned at close)" in report


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_writer_thread_never_blocks_submit_or_close(caplog):
    class Dies(_SlowSink):
        name = "dies"

        def write(self, record: StepRecord) -> None:
            raise SystemExit  # a BaseException ends the thread itself

    writer = SinkWriter([Dies(0)], max_pending=4, close_timeout=2.0)
    start = time.monotonic()
    for step in range(100):
        writer.submit(_record(step))
    writer.close()
    assert time.monotonic() - start < 2.0  # a blocking put would hang here for good
    (report,) = _messages(caplog, "output dies did not write")
    assert "of 100 records" in report


def test_a_failing_write_job_warns_once_and_the_next_jobs_still_run(tmp_path, caplog):
    writer = SinkWriter([])
    done = []
    writer.submit(lambda: 1 / 0)
    writer.submit(lambda: 1 / 0)
    writer.submit(lambda: done.append(1))
    writer.close()
    assert done == [1]
    assert len(_messages(caplog, "output jobs: a write failed (ZeroDivisionError")) == 1
    assert "did not write 2 of 3 records" in _messages(caplog, "output jobs did not write")[0]


def test_anomalies_jsonl_is_written_off_the_training_thread_and_appended_on_resume(tmp_path):
    path = tmp_path / "run" / "rank0" / "anomalies.jsonl"
    action = JsonlAction(path)
    action([_event(0), _event(1)])
    assert action.flush()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1]
    action.close()
    action.close()
    with open(path, "a") as handle:
        handle.write('{"step": 2, "trunc')  # killed mid-line
    again = JsonlAction(path)
    again([_event(3)])
    again.close()
    lines = path.read_text().splitlines()
    assert lines[:2] == [_event(0).to_json(), _event(1).to_json()] and json.loads(lines[-1])["step"] == 3


def test_a_slow_disk_never_slows_anomaly_processing(tmp_path, monkeypatch):
    from trainmon.anomaly import responses
    from trainmon.anomaly.engine import AnomalyEngine
    from trainmon.config import AnomalyConfig

    release, lines = threading.Event(), []

    class SlowDisk:
        def write(self, text: str) -> None:
            release.wait(10)  # every write hangs until the test lets it go
            lines.append(text)

        def flush(self) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setattr(responses, "_open_append", lambda path, root: SlowDisk())
    engine = AnomalyEngine(AnomalyConfig(actions=["jsonl"]), rank=0, rank_dir=tmp_path)
    try:
        start = time.perf_counter()
        for step in range(5):
            assert len(engine.process(StepRecord(step=step, rank=0, scalars={"loss": math.nan}))) == 1
        # a synchronous write would wait 10 s; the disk has not taken a single line yet
        assert time.perf_counter() - start < 2.0 and lines == []
    finally:
        release.set()
        engine.close()
    assert len(lines) == 5


# ------------------------------------------------------------------ symlinks are never followed
@pytest.fixture
def outside(tmp_path):
    """A file and a directory outside the run directory, to be left exactly as they are."""
    target = tmp_path / "outside"
    target.mkdir()
    (target / "precious.txt").write_text("do not touch\n")
    return target


def _untouched(outside: Path) -> bool:
    return sorted(p.name for p in outside.iterdir()) == ["precious.txt"] and \
        (outside / "precious.txt").read_text() == "do not touch\n"


def test_a_symlinked_csv_file_is_not_followed(tmp_path, outside, caplog):
    rank_dir = tmp_path / "run" / "rank0"
    rank_dir.mkdir(parents=True)
    (rank_dir / "scalars.csv").symlink_to(outside / "precious.txt")
    _write_all([CsvSink(rank_dir)], [_record(0)])
    assert _untouched(outside) and (rank_dir / "scalars.csv").is_symlink()
    (warning,) = _messages(caplog, "output csv failed and is disabled")
    assert "refusing to follow a symlink" in warning and "scalars.csv" in warning


def test_a_symlinked_rank_directory_is_not_followed_by_any_output(tmp_path, outside, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "rank0").symlink_to(outside, target_is_directory=True)
    rank_dir = run_dir / "rank0"
    _write_all([CsvSink(rank_dir), TensorBoardSink(rank_dir)], [_record(0)])
    jsonl = JsonlAction(rank_dir / "anomalies.jsonl")
    jsonl([_event(0)])
    jsonl.close()
    with pytest.raises(UnsafePathError):
        write_json(rank_dir / "module_struct.json", {}, root=run_dir)
    with pytest.raises(UnsafePathError):
        make_dirs(rank_dir / "dump" / "step0", run_dir)
    assert _untouched(outside)
    for name in ("csv", "tensorboard", "anomalies.jsonl"):
        assert len(_messages(caplog, f"output {name} failed and is disabled")) == 1, name


def test_write_json_refuses_a_symlink_instead_of_replacing_or_following_it(tmp_path, outside):
    (tmp_path / "run.json").symlink_to(outside / "precious.txt")
    with pytest.raises(UnsafePathError):
        write_json(tmp_path / "run.json", {"a": 1})
    assert _untouched(outside) and (tmp_path / "run.json").is_symlink()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
    write_json(tmp_path / "other.json", {"a": 1})
    assert json.loads((tmp_path / "other.json").read_text()) == {"a": 1}


def test_safe_io_refuses_fifos_hard_links_and_paths_outside_the_root(tmp_path, outside):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError):  # would block forever with a plain open()
        open_output(tmp_path / "fifo", "a")
    os.link(outside / "precious.txt", tmp_path / "linked.txt")
    with pytest.raises(UnsafePathError, match="hard links"):
        open_output(tmp_path / "linked.txt", "a")
    with pytest.raises(UnsafePathError):
        open_output(tmp_path / ".." / "escape.txt", "a", root=tmp_path)
    with pytest.raises(UnsafePathError):
        write_atomic(outside / "precious.txt", b"x", root=tmp_path / "run")
    with pytest.raises(ValueError):
        open_output(tmp_path / "x.txt", "w")  # there is no truncating mode
    assert _untouched(outside)


def test_tensorboard_never_reuses_an_existing_event_file(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)  # both sinks pick the same file name
    for step in (0, 1):
        _write_all([TensorBoardSink(tmp_path / "run" / "rank0")], [_record(step)])
    files = sorted(p.name for p in (tmp_path / "run" / "rank0").iterdir())
    assert len(files) == 2 and files[1] == files[0] + ".1"
    monkeypatch.undo()
    events = EventAccumulator(str(tmp_path / "run" / "rank0")).Reload()
    assert sorted(e.step for e in events.Scalars("scalars/loss")) == [0, 1]


@pytest.fixture(autouse=True)
def _warnings(caplog):
    caplog.set_level(logging.WARNING, logger="trainmon")


def test_previous_run_finds_the_last_step_from_the_tails_only(tmp_path, monkeypatch):
    """A reused run_name is found at attach from the end of its files: a cut last line is skipped, the largest
    step of the newest files wins, and no file is read whole (reads are counted)."""
    from trainmon.base import inputs
    from trainmon.runtime import rundir

    run_dir, rank_dir = tmp_path / "run", tmp_path / "run" / "rank0"
    assert rundir.previous_run(run_dir, rank_dir) is None
    rank_dir.mkdir(parents=True)
    assert rundir.previous_run(run_dir, rank_dir) is None  # an empty folder holds no run
    big = "".join(f'0,"layers.{i % 50}.weight, odd",{i // 50},0,1.5\n' for i in range(200_000))  # ~6 MB
    (rank_dir / "grad_reduced.csv").write_text("vpp_stage,name,step,micro_step,norm\n" + big + "0,w,99999")
    (rank_dir / "scalars.csv").write_text("step,name,value\n0,loss,1.0\n1,loss,0.5\n")
    (rank_dir / "anomalies.jsonl").write_text(json.dumps({"step": 7}) + "\n")
    read: list[int] = []
    real = inputs.open_regular

    def counting(path, *args, **kwargs):
        handle = real(path, *args, **kwargs)
        original = handle.read
        handle.read = lambda size=-1: (read.append(size), original(size))[1]
        return handle

    monkeypatch.setattr(rundir, "open_regular", counting)
    assert rundir.previous_run(run_dir, rank_dir) == "last step 3999"
    assert read and all(0 < size <= 64 * 1024 for size in read), read
    (rank_dir / "grad_reduced.csv").unlink()
    (rank_dir / "scalars.csv").unlink()
    (rank_dir / "anomalies.jsonl").write_text('{"step": 7}\n{"step": 8, "cut')
    assert rundir.previous_run(run_dir, rank_dir) == "last step 7"
    (rank_dir / "anomalies.jsonl").unlink()
    (run_dir / "run.json").write_text("{}")
    assert rundir.previous_run(run_dir, rank_dir) == "last step unknown"
    # the default sinks write no CSV: the store's part names hold the step range (this rank's parts only)
    from trainmon.sinks.store_layout import part_name

    for table, rank, last in [("scalars", 0, 9), ("actv", 0, 10), ("scalars", 1, 50)]:
        folder = run_dir / "store" / table / f"rank={rank}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / part_name(0, last, "ab12cd34", 0, 0)).write_bytes(b"")
    (run_dir / "store" / "scalars" / "rank=0" / ".part-000000000-000000099-tmp.parquet").write_bytes(b"")
    assert rundir.previous_run(run_dir, rank_dir) == "last step 10"
