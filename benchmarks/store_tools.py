"""Benchmark ``trainmon report`` and ``trainmon csv2tb`` (its overview, and ``--per-tensor``) on a run's CSV files
and on its store (docs/store.md).

Usage: ``python benchmarks/store_tools.py [--tensors 292] [--steps 2000] [--dir DIR]``

Writes one rank of ``--tensors`` rows per step (half ``actv``, half ``grad_reduced``, the 7 default metrics,
lognormal values) through the real CSV and Parquet sinks (a clock that never rolls: the store is one merged part
per table, as a run that closed), copies the run without its CSV files and without its store, then runs each command
once on each copy in a fresh process and prints its wall time and peak memory (``ru_maxrss`` of that process).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from trainmon.base.records import METRICS, Row, RowKey, StepRecord
from trainmon.sinks.csv import CsvSink
from trainmon.sinks.parquet import ParquetSink

_CHILD = ("import json, resource, sys, time\n"
          "from trainmon.tools.cli import main\n"
          "start = time.perf_counter(); code = main(sys.argv[1:])\n"
          "print(json.dumps([code, time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss]))")


def write_run(run_dir: Path, tensors: int, steps: int) -> None:
    """The synthetic run through both sinks."""
    rng = np.random.default_rng(0)
    names = [f"model.layers.{i // 4}.block{i % 4}.weight" for i in range(tensors)]
    (run_dir / "rank0").mkdir(parents=True)
    sinks = [ParquetSink(run_dir / "rank0", root=run_dir, clock=lambda: 0.0), CsvSink(run_dir / "rank0", root=run_dir)]
    for step in range(steps):
        values = rng.lognormal(size=(tensors, len(METRICS))).tolist()
        rows = [Row(RowKey("actv" if i % 2 else "grad_reduced", names[i], 0, 0, i), step,
                    dict(zip(METRICS, values[i])), False) for i in range(tensors)]
        record = StepRecord(step=step, rank=0, rows=rows, scalars={"loss": values[0][0]}, pp_stage=0)
        for sink in sinks:
            sink.write(record)
    for sink in sinks:
        sink.close()


def measure(argv: list[str]) -> tuple[float, float]:
    """``(seconds, peak MB)`` of one ``trainmon`` command in a process of its own."""
    result = subprocess.run([sys.executable, "-c", _CHILD, *argv], capture_output=True, text=True, check=True)
    code, seconds, peak_kb = json.loads(result.stdout.strip().splitlines()[-1])
    assert code == 0, result.stderr
    return seconds, peak_kb / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=292)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    base = args.dir or Path(tempfile.mkdtemp(prefix="store_tools_"))
    start = time.perf_counter()
    # written in a process of its own: a child forked from a big parent would report the parent's memory
    writer = multiprocessing.get_context("spawn").Process(target=write_run,
                                                          args=(base / "run", args.tensors, args.steps))
    writer.start()
    writer.join()
    assert writer.exitcode == 0
    rows = args.tensors * args.steps
    shutil.copytree(base / "run", base / "store_only")
    for path in (base / "store_only").rglob("*.csv"):
        path.unlink()
    shutil.copytree(base / "run", base / "csv_only")  # report reads the store of a run that has both
    shutil.rmtree(base / "csv_only" / "store")
    print(f"{rows} rows written in {time.perf_counter() - start:.1f} s")
    for label in ("csv_only", "store_only"):
        run = base / label
        for name, argv in (("report", ["report", str(run), "-o", str(base / f"{label}.html")]),
                           ("report --metrics norm", ["report", str(run), "-o", str(base / f"{label}-norm.html"),
                                                      "--metrics", "norm"]),
                           ("csv2tb", ["csv2tb", str(run), "-o", str(base / f"tb-{label}")]),
                           ("csv2tb --per-tensor", ["csv2tb", str(run), "-o", str(base / f"tb-{label}-all"),
                                                    "--per-tensor"])):
            seconds, peak = measure(argv)
            print(f"{'CSV' if label == 'csv_only' else 'store'} {name}: {seconds:.2f} s, peak {peak:.0f} MB")
    if args.dir is None:
        shutil.rmtree(base)


if __name__ == "__main__":
    main()
