"""Benchmark the run store: write a synthetic run through the real Parquet sink, then time DuckDB queries.

Usage: ``python benchmarks/store_scale.py [--ranks 64] [--tensors 292] [--steps 536] [--dir DIR] [--keep]``
(the defaults make 10^7 rows: 64 ranks x 292 rows per step x 536 steps); ``--real-steps N``: instead, bytes per
row of a real torch run (a small transformer with the default config), Parquet beside CSV. ``--replicate K``:
after the run is written, each rank's folders are copied K - 1 times as further ranks (``rank=R + i x ranks``),
so a 10^9-row run is queried without writing 10^9 rows through the writer on this machine (~70 min): the
files are the writer's own, byte for byte, and the copies are real files (no links, no shared page cache).

Each rank gets its own :class:`~trainmon.sinks.parquet.ParquetSink`, fed :class:`StepRecord` s as the writer
thread feeds it, with a clock that advances ``--step-seconds`` per step (2 s: every step rolls a file, the worst
case for file counts). Half of each step's rows are ``actv`` (forward), half ``grad_reduced`` (optimizer), with
the 7 default metrics: norms lognormal per tensor with a slow random walk, min/max/sum float32 values, mean and
zeros float64 quotients as trainmon computes them, spikes (x1000) in 1 row of 10^4, and a NaN entering at one
rank and one tensor mid-run that spreads to the later rows of that rank and to every rank in the next step
(after which the run recovers: a run that stays NaN would make the files unrealistically small).

``--query RUN``: only time the queries on a run written before (kept with ``--keep``), in a fresh process: the first
call reads what the page cache does not hold. Every timing is printed with the load average (other jobs on the
machine slow it).

Prints bytes per row, files per table and rank, the writer's throughput (metric values per second, the sink's
own time: rows to columns, Parquet encoding, files), and the time of two queries over all ranks:
the first non-finite origin in execution order, and a per-(step, tensor) cross-rank aggregate.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from trainmon.base.records import METRICS, Row, RowKey, StepRecord
from trainmon.sinks.parquet import ParquetSink
from trainmon.tools.store import open_run

FIRST_NONFINITE = """
SELECT rank, step, micro_step, phase, name, "order" FROM (
    SELECT rank, step, micro_step, phase, pp_stage, "order", name FROM actv WHERE nonfinite
    UNION ALL
    SELECT rank, step, micro_step, phase, pp_stage, "order", name FROM grad_reduced WHERE nonfinite)
ORDER BY step, micro_step,
    CASE phase WHEN 'forward' THEN 0 WHEN 'loss' THEN 1 WHEN 'backward' THEN 2 WHEN 'communication' THEN 3 ELSE 4 END,
    CASE WHEN phase = 'backward' THEN -pp_stage ELSE pp_stage END, "order", rank
LIMIT 1"""
CROSS_RANK = """
SELECT count(*), max(spread) FROM (
    SELECT step, name, max(norm) - min(norm) AS spread, avg(norm) AS mean, stddev_pop(norm) AS std,
           arg_max(rank, norm) AS top_rank
    FROM grad_reduced GROUP BY step, name)"""


class StepClock:
    """A clock the benchmark advances by one training step at a time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


SINK_CPU = [0.0]
"""CPU seconds of the process spent in the sinks (:func:`write_run` adds them; robust to other jobs' load)."""


def write_run(run_dir: Path, ranks: int, tensors: int, steps: int, step_seconds: float,
              seed: int = 0) -> tuple[int, float, tuple[int, int, int]]:
    """Write the synthetic run; returns (rows, seconds spent in the sinks, (nan step, nan rank, nan order))."""
    rng = np.random.default_rng(seed)
    half = tensors // 2
    keys = [RowKey("actv", f"model.layers.{i // 4}.block{i % 4}.output", order=i) for i in range(half)]
    keys += [RowKey("grad_reduced", f"model.layers.{i // 9}.param{i % 9}.weight", order=half + i)
             for i in range(tensors - half)]
    numel = rng.integers(1 << 12, 1 << 24, tensors).astype(np.float64)
    base = np.exp(rng.normal(np.log(0.1), 1.5, tensors))
    nan_at = (steps // 2, ranks // 3, half // 2)
    rows, sink_seconds = 0, 0.0
    for rank in range(ranks):
        clock = StepClock()
        sink = ParquetSink(run_dir / f"rank{rank}", root=run_dir, clock=clock)
        walk = base * np.exp(rng.normal(0, 0.05, tensors))
        for step in range(steps):
            walk *= np.exp(rng.normal(0, 0.01, tensors))
            norm = walk.astype(np.float32).astype(np.float64)
            norm = np.where(rng.random(tensors) < 1e-4, norm * 1000, norm)  # spikes
            top = (norm / np.sqrt(numel) * rng.uniform(3, 6, tensors)).astype(np.float32).astype(np.float64)
            low = -(top * rng.uniform(0.8, 1.2, tensors)).astype(np.float32).astype(np.float64)
            total = (rng.normal(0, 1, tensors) * norm).astype(np.float32).astype(np.float64)
            zeros = np.where(rng.random(tensors) < 0.9, 0.0, rng.integers(0, 50, tensors) / numel)
            nans = np.zeros(tensors)
            if step == nan_at[0] + 1 or (step == nan_at[0] and rank == nan_at[1]):
                first = nan_at[2] if step == nan_at[0] else 0
                nans[first:] = 1.0
            bad = nans > 0
            columns = [np.where(bad, np.nan, norm), np.where(bad, np.nan, low), np.where(bad, np.nan, top),
                       np.where(bad, np.nan, total / numel), zeros, nans, np.zeros(tensors)]
            values = list(zip(*(c.tolist() for c in columns)))
            rows_of_step = [Row(key, step, dict(zip(METRICS, v)), f) for key, v, f in zip(keys, values, bad.tolist())]
            record = StepRecord(step=step, rank=rank, rows=rows_of_step, scalars={"loss": float(2.0 + rng.normal())})
            clock.now += step_seconds
            start, cpu = time.perf_counter(), time.process_time()
            sink.write(record)
            sink.flush()
            sink_seconds += time.perf_counter() - start
            SINK_CPU[0] += time.process_time() - cpu
            rows += tensors
        start, cpu = time.perf_counter(), time.process_time()
        sink.close()
        sink_seconds += time.perf_counter() - start
        SINK_CPU[0] += time.process_time() - cpu
    return rows, sink_seconds, nan_at


def replicate(run_dir: Path, ranks: int, copies: int) -> int:
    """Copy every ``rank=R`` folder of every table as ``rank=R + i * ranks`` for i in 1..copies-1; returns the files
    made. A copy of the NaN rank holds the NaN at the same step and order, but a higher rank: the first origin
    (ties broken by rank) stays the written one."""
    made = 0
    for table in (run_dir / "store").iterdir():
        for rank in range(ranks):
            source = table / f"rank={rank}"
            for i in range(1, copies):
                shutil.copytree(source, table / f"rank={rank + i * ranks}")
                made += sum(1 for _ in source.iterdir())
    return made


def real_run(out: Path, steps: int) -> None:
    """Bytes per row on disk of a real torch run (a small transformer, AdamW, the default config's families and
    metrics), Parquet beside CSV: the same rows in both."""
    import torch

    from trainmon import TrainerMonitor

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Embedding(100, 64), torch.nn.TransformerEncoder(layer, 6),
                                torch.nn.Linear(64, 100))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {"output_dir": str(out), "run_name": "real", "sinks": ["parquet", "csv"]}
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer)
        for _ in range(steps):
            tokens = torch.randint(0, 100, (4, 16))
            loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(loss=loss)
    run_dir = out / "real"
    con = open_run(run_dir)
    tables = [name for (name,) in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()
              if name not in ("scalars", "anomalies")]
    rows = sum(con.execute(f'SELECT count(*) FROM "{name}"').fetchall()[0][0] for name in tables)
    parquet = sum(p.stat().st_size for name in tables for p in (run_dir / "store" / name).rglob("*.parquet"))
    csv = sum((run_dir / "rank0" / f"{name}.csv").stat().st_size for name in tables)
    print(f"real run ({steps} steps, {len(list(model.parameters()))} parameter tensors, families {', '.join(tables)}): "
          f"{rows:,} rows; Parquet {parquet / rows:.2f} bytes per row, CSV {csv / rows:.2f}")


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def count_files(run_dir: Path) -> None:
    """Files per table and rank (the most and the mean) and the store's bytes."""
    counts: dict[tuple[str, str], int] = {}
    size = 0
    for path in (run_dir / "store").rglob("part-*.parquet"):
        key = (path.parent.parent.name, path.parent.name)
        counts[key] = counts.get(key, 0) + 1
        size += path.stat().st_size
    if counts:
        print(f"{sum(counts.values()):,} parts ({size / 1e9:.2f} GB) in {len(counts):,} folders of a table and rank: "
              f"at most {max(counts.values())}, {sum(counts.values()) / len(counts):.1f} on average")


def time_queries(run_dir: Path, nan_at: tuple[int, int, int] | None) -> None:
    """Time open_run and the two queries (the first call, then the best of two more), each with the load."""
    start = time.perf_counter()
    con = open_run(run_dir)
    print(f"open_run: {time.perf_counter() - start:.2f} s ({load()})")
    rows = con.execute("SELECT count(*) FROM grad_reduced").fetchall()[0][0] * 2
    for label, sql in (("first non-finite origin", FIRST_NONFINITE), ("cross-rank aggregate", CROSS_RANK)):
        timings = []
        for _ in range(3):
            start = time.perf_counter()
            result = con.execute(sql).fetchall()
            timings.append(time.perf_counter() - start)
            print(f"  {label}: {timings[-1]:.2f} s ({load()})", flush=True)
        print(f"{label}: first {timings[0]:.2f} s, best {min(timings[1:]):.2f} s over {rows:,} rows -> {result}")
    origin = con.execute(FIRST_NONFINITE).fetchall()[0]
    if nan_at is not None:
        assert (origin[1], origin[0], origin[5]) == nan_at, (origin, nan_at)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--tensors", type=int, default=292, help="rows per step and rank (half actv, half grads)")
    parser.add_argument("--steps", type=int, default=536)
    parser.add_argument("--step-seconds", type=float, default=2.0, help="clock per step (2: a file per step)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the run (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the run")
    parser.add_argument("--real-steps", type=int, default=0, help="instead: a real torch run of this many steps")
    parser.add_argument("--replicate", type=int, default=1, help="copy the ranks' files K - 1 times as more ranks")
    parser.add_argument("--query", type=Path, default=None, help="only time the queries on this run (its run/)")
    args = parser.parse_args()
    if args.query is not None:
        count_files(args.query)
        time_queries(args.query, None)
        return
    root = Path(tempfile.mkdtemp(dir=args.dir))
    run_dir = root / "run"
    try:
        if args.real_steps:
            real_run(root, args.real_steps)
            return
        start = time.perf_counter()
        rows, sink_seconds, nan_at = write_run(run_dir, args.ranks, args.tensors, args.steps, args.step_seconds)
        total = time.perf_counter() - start
        files = list((run_dir / "store").rglob("*.parquet"))
        row_bytes = sum(p.stat().st_size for p in files if "scalars" not in p.parts)
        tables = {p.parent.parent.name for p in files}
        print(f"wrote {rows:,} rows ({args.ranks} ranks x {args.tensors} rows x {args.steps} steps) in {total:.1f} s; "
              f"sinks' own time {sink_seconds:.1f} s = {rows * len(METRICS) / sink_seconds:,.0f} values/s "
              f"({rows / sink_seconds:,.0f} rows/s) per process; CPU {SINK_CPU[0]:.1f} s = "
              f"{rows * len(METRICS) / SINK_CPU[0]:,.0f} values per CPU second ({load()})")
        print(f"store: {row_bytes / rows:.2f} bytes per row ({row_bytes / 1e6:.1f} MB of row tables), "
              f"{len(files)} files = {len(files) / (len(tables) * args.ranks):.1f} per table and rank ({load()})")
        if args.replicate > 1:
            start = time.perf_counter()
            made = replicate(run_dir, args.ranks, args.replicate)
            rows *= args.replicate
            print(f"copied the {args.ranks} ranks' files {args.replicate - 1} times ({made:,} files, "
                  f"{time.perf_counter() - start:.0f} s): {args.ranks * args.replicate} ranks, {rows:,} rows")
            count_files(run_dir)
        time_queries(run_dir, nan_at)
    finally:
        if args.keep:
            print(f"kept {run_dir}")
        else:
            shutil.rmtree(root)


if __name__ == "__main__":
    main()
