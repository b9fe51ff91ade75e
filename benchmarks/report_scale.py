"""Benchmark ``trainmon report`` on 1,000 modules x 10,000 steps.

Usage: ``python benchmarks/report_scale.py [--modules 1000] [--steps 10000] [--metrics norm max] [--dir DIR]``.

Writes a synthetic run in the CSV sink's format (one rank: ``grad_reduced.csv`` with one row per
module and step, ``scalars.csv`` with loss, grad_norm and lr, ``anomalies.jsonl`` with a NaN burst
from step 7,000), then times ``trainmon report`` (reading, binning to 1,000 columns, writing the
page) and prints ``report: R rows x M metrics -> HTML of B MB in T s (peak RSS P GB)``.
Generation is not timed.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from trainmon.tools.report import build


def write_run(root: Path, modules: int, steps: int, metrics: list[str], seed: int = 0) -> int:
    """The synthetic run; returns the number of CSV data rows written."""
    rng = np.random.default_rng(seed)
    rank_dir = root / "rank0"
    rank_dir.mkdir(parents=True)
    kinds = ("q", "k", "v", "o", "fc1", "fc2", "ln1", "ln2")
    names = [f"layers.{i // 8}.{kinds[i % 8]}.weight" for i in range(modules)]
    scale = rng.lognormal(0, 1.5, modules)
    prefix = [f"0,{name}," for name in names]
    with open(rank_dir / "grad_reduced.csv", "w", newline="") as handle:
        handle.write("vpp_stage,name,step,micro_step," + ",".join(metrics) + "\n")
        for step in range(steps):
            values = scale[:, None] * rng.lognormal(0, 0.2, (modules, len(metrics))) * (1 + step / steps)
            if step >= 7000:
                values[modules // 3] = np.nan  # one module goes NaN
            text = np.char.mod("%.6g", values)
            handle.write("".join(f"{p}{step},0,{','.join(row)}\n" for p, row in zip(prefix, text.tolist())))
    loss = 5 * np.exp(-np.arange(steps) / 3000) + rng.normal(0, 0.05, steps)
    with open(rank_dir / "scalars.csv", "w") as handle:
        handle.write("step,name,value\n")
        for step in range(steps):
            handle.write(f"{step},loss,{loss[step]!r}\n{step},grad_norm,{float(scale.sum()):.6g}\n"
                         f"{step},lr/group0,0.001\n")
    with open(rank_dir / "anomalies.jsonl", "w") as handle:
        for step in range(7000, steps, 10):
            handle.write(json.dumps({"step": step, "micro_step": 0, "rank": 0, "phase": "optimizer",
                                     "pp_stage": 0, "vpp_stage": 0, "order": modules // 3, "detector": "nonfinite",
                                     "family": "grad_reduced", "name": names[modules // 3], "metric": "norm",
                                     "value": "nan", "baseline": "nan", "message": f"{names[modules // 3]} norm is nan",
                                     "time": "2026-01-01T00:00:00.000Z"}, separators=(",", ":")) + "\n")
    return modules * steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--metrics", nargs="+", default=["norm", "max"])
    parser.add_argument("--dir", type=Path, default=None, help="where to write the run (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = (args.dir or Path(tmp)) / "run"
        started = time.perf_counter()
        rows = write_run(root, args.modules, args.steps, args.metrics)
        size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        print(f"wrote {rows:,} rows ({size / 1e6:.0f} MB of CSV) in {time.perf_counter() - started:.0f} s",
              file=sys.stderr)
        out = root / "report.html"
        started = time.perf_counter()
        cpu = time.process_time()
        summary = build(root, out, progress=False)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux
        print(f"report: {rows:,} rows x {len(args.metrics)} metrics -> {summary['heatmaps']} heatmaps, HTML of "
              f"{summary['bytes'] / 1e6:.1f} MB in {wall:.1f} s wall, {cpu:.1f} s CPU (peak RSS {peak:.1f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
