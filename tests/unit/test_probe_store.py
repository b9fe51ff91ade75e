"""trainmon.probe.store: the grad probe's store tables rolled on the clock and by bytes, merged by count and bytes,
large parameters split into chunks and put back together, unreadable parts reported (no framework)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainmon.probe import store as probe_store
from trainmon.probe.storage import DirectionFormatError
from trainmon.probe.store import ProbeStore, read_summary, scan_directions, store_columns, stored_ranks
from trainmon.sinks.store_layout import GRAD_DIRECTIONS, GRAD_PROBE, live_parts, table_dir
from trainmon.sinks.store_parts import TableParts
from trainmon.tools.cli import main as cli_main


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def step_data(step: int, sizes: list[int], level: str = "L1", sample: int | None = None):
    """metas, stats and packed bits of one step of parameters of ``sizes`` elements (signs from a seeded rng)."""
    rng = np.random.default_rng(step)
    metas, bits, signs = [], [], []
    for i, size in enumerate(sizes):
        count = size if sample is None or size <= sample else sample
        positive = rng.random(count) > 0.5
        signs.append(positive)
        bits.append(np.packbits(positive, bitorder="little"))
        metas.append({"name": f"p{i}", "vpp_stage": 0, "shape": [size], "numel": size, "dtype": "float32",
                      "count": count, "sample": None if count == size else
                      {"method": "stratified", "seed": 0, "elements": count}})
    width = 7 if level != "L2" else 12
    stats = rng.standard_normal((len(sizes), width)).astype(np.float32)
    return metas, stats, bits, signs


def files(run, table):
    return sorted(table_dir(run, table, 0).glob("*.parquet"))


def test_rows_roll_on_the_clock_and_merge_at_close(tmp_path):
    clock = Clock()
    store = ProbeStore(tmp_path, 0, "L1", [], clock=clock)
    for step in range(3):
        store.write_step(step, *step_data(step, [10, 20])[:2], None, step_data(step, [10, 20])[2])
        store.flush()
    assert files(tmp_path, GRAD_PROBE) == []  # within roll_seconds: in memory only
    clock.now = 2.5
    store.flush()
    assert len(files(tmp_path, GRAD_PROBE)) == 1 and len(files(tmp_path, GRAD_DIRECTIONS)) == 1
    metas, stats, bits, _ = step_data(3, [10, 20])
    store.write_step(3, metas, stats, None, bits)
    store.close()
    (summary,) = files(tmp_path, GRAD_PROBE)
    (directions,) = files(tmp_path, GRAD_DIRECTIONS)
    assert summary.name.startswith("part-000000000-000000003-")
    table = read_summary([summary])
    assert table.column_names == store_columns("L1", [])
    assert table.column("step").to_pylist() == [0, 0, 1, 1, 2, 2, 3, 3]
    np.testing.assert_array_equal(table.column("norm").to_numpy()[-2:], stats[:, 2])  # float32, exactly
    with open(directions, "rb") as handle:
        schema = pq.read_schema(handle)
    assert json.loads(schema.metadata[b"trainmon.grad_directions"])["sign"] == "x > 0"


def test_bits_roll_by_bytes_and_large_parts_are_not_rewritten(tmp_path):
    """roll_bytes writes a step's bits at once; a small part of merge_bytes or more is kept as it is, the smaller
    ones around it merge among themselves (their sequence ranges never cover it)."""
    store = ProbeStore(tmp_path, 0, "L1", [], roll_seconds=3600.0, roll_bytes=100, merge_bytes=10_000)
    sizes = {0: [800], 1: [800], 2: [16000], 3: [800], 4: [800]}  # 100, 100, 2000, 100, 100 bytes of bits
    for step, size in sizes.items():
        metas, stats, bits, _ = step_data(step, size)
        store.write_step(step, metas, stats, None, bits)
    large = [p for p in files(tmp_path, GRAD_DIRECTIONS) if "-000000002-000000002-" in p.name]
    assert len(large) == 1
    store.close()
    parts = live_parts(files(tmp_path, GRAD_DIRECTIONS))
    assert [(p.first_step, p.last_step) for p in parts] == [(0, 1), (2, 2), (3, 4)]
    assert large[0].exists()  # never merged, never rewritten
    tree = scan_directions(tmp_path)
    for step, size in sizes.items():
        _, _, _, signs = step_data(step, size)
        stored = tree[0][step][(0, "p0")].bits()
        np.testing.assert_array_equal(np.unpackbits(stored, bitorder="little")[: size[0]], signs[0])


def test_a_step_of_many_bits_rolls_within_the_step(tmp_path):
    """roll_bytes is checked after each parameter: a step's bits never wait whole in the store's memory."""
    store = ProbeStore(tmp_path, 0, "L1", [], roll_seconds=3600.0, roll_bytes=150, merge_bytes=1 << 20)
    metas, stats, bits, signs = step_data(0, [800, 800, 800])  # 100 bytes of bits each
    store.write_step(0, metas, stats, None, bits)
    (part,) = files(tmp_path, GRAD_DIRECTIONS)  # p0 and p1; p2 is in memory
    with open(part, "rb") as handle:
        assert pq.read_table(handle, columns=["name"]).column(0).to_pylist() == ["p0", "p1"]
    store.close()
    entries = scan_directions(tmp_path)[0][0]
    for i in range(3):
        np.testing.assert_array_equal(np.unpackbits(entries[(0, f"p{i}")].bits(), bitorder="little"), signs[i])


def test_fan_in_merges_small_parts(tmp_path):
    clock = Clock()
    store = ProbeStore(tmp_path, 0, "L0", [], clock=clock, fan_in=4)
    for step in range(10):
        metas, stats, _, _ = step_data(step, [5, 6, 7])
        store.write_step(step, metas, stats[:, :7], [f"{step:016x}"] * 3, [])
        clock.now += 3
        store.flush()
    assert len(live_parts(files(tmp_path, GRAD_PROBE))) == 4  # 0-3, 4-7 merged; 8 and 9 still small
    store.close()
    assert [(p.first_step, p.last_step) for p in live_parts(files(tmp_path, GRAD_PROBE))] == [(0, 3), (4, 7), (8, 9)]
    assert read_summary(files(tmp_path, GRAD_PROBE)).column("hash").to_pylist()[-1] == f"{9:016x}"
    assert files(tmp_path, GRAD_DIRECTIONS) == []  # L0: no directions


def test_large_parameters_take_one_row_per_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(probe_store, "CHUNK_ELEMENTS", 16)
    store = ProbeStore(tmp_path, 3, "L1", [])
    metas, stats, bits, signs = step_data(7, [100, 16, 5])
    store.write_step(7, metas, stats, None, bits)
    store.close()
    (part,) = sorted(table_dir(tmp_path, GRAD_DIRECTIONS, 3).glob("*.parquet"))
    with open(part, "rb") as handle:
        table = pq.read_table(handle)
    assert table.column("name").to_pylist() == ["p0"] * 7 + ["p1", "p2"]
    assert table.column("first").to_pylist() == [0, 16, 32, 48, 64, 80, 96, 0, 0]
    tree = scan_directions(tmp_path)
    assert set(tree) == {3}
    for i, size in enumerate([100, 16, 5]):
        entry = tree[3][7][(0, f"p{i}")]
        assert entry.header["count"] == size and entry.header["shape"] == [size]
        np.testing.assert_array_equal(np.unpackbits(entry.bits(), bitorder="little")[:size], signs[i])


def test_sampled_directions_keep_their_sample(tmp_path):
    store = ProbeStore(tmp_path, 0, "L2", [-1.0, 0.0, 1.0])
    metas, stats, bits, _ = step_data(0, [100, 8], level="L2", sample=10)
    store.write_step(0, metas, stats, None, bits)
    store.close()
    entries = scan_directions(tmp_path)[0][0]
    assert entries[(0, "p0")].header["sample"] == {"method": "stratified", "seed": 0, "elements": 10}
    assert entries[(0, "p1")].header["sample"] is None and entries[(0, "p0")].header["count"] == 10
    assert store_columns("L2", [-1.0, 0.0, 1.0])[-5:] == ["interval_-inf_-1", "interval_-1_0", "interval_0_1",
                                                          "interval_1_inf", "zero_fraction"]


def test_a_resumed_writer_writes_beside_the_first(tmp_path):
    for start in (0, 5):
        store = ProbeStore(tmp_path, 0, "L1", [])
        for step in range(start, start + 2):
            metas, stats, bits, _ = step_data(step, [9])
            store.write_step(step, metas, stats, None, bits)
        store.close()
    assert len(files(tmp_path, GRAD_DIRECTIONS)) == 2
    assert sorted(scan_directions(tmp_path)[0]) == [0, 1, 5, 6]
    assert list(stored_ranks(tmp_path, GRAD_PROBE)) == [0]


def _write_part(path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        pq.write_table(table, handle)


def test_unreadable_parts_are_reported(tmp_path, capsys):
    run = tmp_path / "run"
    store = ProbeStore(run, 0, "L1", [])
    metas, stats, bits, _ = step_data(0, [9, 30])
    store.write_step(0, metas, stats, None, bits)
    store.close()
    (good,) = files(run, GRAD_DIRECTIONS)
    broken = good.with_name(good.name.replace("-000001-000001", "-000009-000009").replace("000000000-000000000",
                                                                                         "000000001-000000001"))
    broken.write_bytes(b"PAR1 not a parquet file")
    problems: list[str] = []
    tree = scan_directions(run, problems=problems)
    assert list(tree[0]) == [0] and len(problems) == 1 and broken.name in problems[0]
    with pytest.raises(DirectionFormatError, match=broken.name):
        scan_directions(run)
    broken.unlink()
    with open(good, "rb") as handle:  # a part whose bits are shorter than its count says
        table = pq.read_table(handle)
    short = table.set_column(table.schema.get_field_index("bits"), "bits",
                             pa.array([b"\x01", b"\x02\x03"], pa.large_binary()))
    _write_part(broken, short.set_column(0, "step", pa.array([1, 1], pa.int64())))
    entry = scan_directions(run)[0][1][(0, "p1")]
    with pytest.raises(DirectionFormatError, match="bytes of bits"):
        entry.bits()
    out = tmp_path / "cmp"
    assert cli_main(["grad-compare", str(run), str(run), "-o", str(out), "--no-plots"]) == 0
    problems_text = (out / "problems.txt").read_text()
    assert "p1" in problems_text and "not compared" in problems_text
    capsys.readouterr()


def test_report_names_a_broken_summary_part(tmp_path, capsys):
    run = tmp_path / "run"
    store = ProbeStore(run, 0, "L1", [])
    metas, stats, bits, _ = step_data(0, [9])
    store.write_step(0, metas, stats, None, bits)
    store.close()
    (part,) = files(run, GRAD_PROBE)
    part.write_bytes(part.read_bytes()[:40])  # truncated
    (run / "rank0").mkdir()
    assert cli_main(["report", str(run), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert part.name in err and len(err.strip().splitlines()) == 1


def test_table_parts_merge_bytes(tmp_path):
    """merge_bytes: small parts merge once their files hold that many bytes (here 3 files of ~3.7 kB)."""
    counter = itertools.count().__next__
    folder = tmp_path / "t" / "rank=0"
    parts = TableParts(folder, tmp_path, "ab", counter, merge_bytes=10_000)
    for step in range(7):
        parts.add(pa.table({"step": pa.array([step], pa.int64()),
                            "bits": pa.array([bytes(np.random.default_rng(step).bytes(600))])}), step, step)
    (small,) = folder.glob("*-000006-000006.parquet")
    assert 10_000 / 3 < small.stat().st_size < 10_000 / 2
    assert [(p.first_step, p.last_step) for p in live_parts(sorted(folder.glob("*.parquet")))] == [(0, 2), (3, 5),
                                                                                                   (6, 6)]
    parts.close()
    assert len(list(folder.glob("*.parquet"))) == 3  # a lone small part is left as it is


def test_writing_imports_no_pandas(tmp_path):
    """The writer builds its columns from buffers and merges without ``pq.read_table``: pyarrow would import pandas
    (~0.5 s on the probe's writer thread, whose queue holds 4 steps) at its first ``pa.array``."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        from pathlib import Path
        from trainmon.probe.store import ProbeStore
        store = ProbeStore(Path({str(tmp_path)!r}), 0, "L2", [-1.0, 0.0, 1.0], roll_seconds=0.0, fan_in=2)
        for step in range(3):
            meta = {{"name": "w", "vpp_stage": 0, "shape": [100], "numel": 100, "dtype": "float32", "count": 10,
                     "sample": {{"method": "stratified", "seed": 0, "elements": 10}}}}
            store.write_step(step, [meta], np.zeros((1, 12), np.float32), None, [np.zeros(2, np.uint8)])
            store.flush()
        store.close()
        assert "pandas" not in sys.modules, "pandas imported"
    """)
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=120,
                            env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(scan_directions(tmp_path)[0]) == 3


def test_level_merges_keep_the_probe_tables(tmp_path):
    """fan_in 2: 20 rolls make 10 parts of level 1, 8 of which are merged into one of level 2 (streamed): the tables
    keep their metadata, every step's bits come back exactly, the summary rows in order."""
    clock = Clock()
    store = ProbeStore(tmp_path, 0, "L1", [], clock=clock, fan_in=2)
    for step in range(20):
        metas, stats, bits, _ = step_data(step, [300, 70])
        store.write_step(step, metas, stats, None, bits)
        clock.now += 3
        store.flush()
    store.close()
    parts = live_parts(files(tmp_path, GRAD_DIRECTIONS))
    assert [(p.first_step, p.last_step) for p in parts] == [(0, 15), (16, 17), (18, 19)]
    for path in files(tmp_path, GRAD_DIRECTIONS):
        with open(path, "rb") as handle:
            assert b"trainmon.grad_directions" in pq.read_schema(handle).metadata
    tree = scan_directions(tmp_path)
    for step in range(20):
        _, _, _, signs = step_data(step, [300, 70])
        for i, size in enumerate((300, 70)):
            stored = tree[0][step][(0, f"p{i}")].bits()
            np.testing.assert_array_equal(np.unpackbits(stored, bitorder="little")[:size], signs[i])
    assert read_summary(files(tmp_path, GRAD_PROBE)).column("step").to_pylist() == [s for s in range(20) for _ in "ab"]


def test_a_level_merge_of_parts_of_other_columns_keeps_them_all(tmp_path):
    """A writer whose columns change (metrics added mid-run) merges parts of both schemas by name, streamed: the
    merged part has every column, nulls where a part had none."""
    folder = tmp_path / "store" / "t" / "rank=0"
    parts = TableParts(folder, tmp_path, "ab", itertools.count().__next__, fan_in=2, level_fan_in=2)
    for step in range(8):
        columns = {"step": pa.array([step], pa.int64()), "norm": pa.array([step / 2])}
        if step >= 4:
            columns["max"] = pa.array([step * 2.0])
        parts.add(pa.table(columns), step, step)
    (merged,) = sorted(folder.glob("*.parquet"))
    with open(merged, "rb") as handle:
        table = pq.read_table(handle)
    assert table.column_names == ["step", "norm", "max"]
    assert table.column("max").to_pylist() == [None] * 4 + [8.0, 10.0, 12.0, 14.0]
    assert table.column("norm").to_pylist() == [s / 2 for s in range(8)]
    assert len(list(folder.glob("_schema-*"))) == 2
