"""Benchmark ``trainmon report`` and ``trainmon serve`` on large runs (docs/performance.md, docs/report.md).

Usage::

    python benchmarks/report_scale.py store [--ranks 64] [--steps 5370] [--families grad_reduced] [--copies 10]
    python benchmarks/report_scale.py csv [--modules 1000] [--steps 10000]
    python benchmarks/report_scale.py screenshot docs/img/report.png

``store``: a synthetic run store at the 7B shape (the 291 parameter names of LlamaForCausalLM with 32 layers;
metrics norm, max, nans; a x8 jump of every gradient at step 65, one layer x8 on one rank later, a NaN on another
rank: :mod:`benchmarks.synthetic_store`, written with pyarrow directly: the real sink writes 264,000 rows/s, an
hour for 10^8 rows on this machine), then times

- the static page (``build``: every query, encoding, writing; its size), in this process (peak RSS);
- ``serve``'s first view: opening the run (catalog, anomalies, the main rank's curves), the page, the family's rows
  and the default grid (module x step of the main rank, ``--max-columns`` buckets), then a drill-down (11 steps of
  one rank at full resolution), a module x rank grid and a rank x step grid of one row;
- with ``--copies N``: the same served views on a run of N times the rows, made of hard links to the first run's
  parts under other ranks (the disk holds one copy; the page cache is warm, so the figures leave out a cold read).

``csv``: the CSV run of the first version of this benchmark (one rank, ``--modules`` x ``--steps`` rows of
``grad_reduced.csv``, metrics norm and max), timed through ``build`` (the CSV files read and taken into DuckDB).

``screenshot``: the docs' screenshot: a 7B-shape store (8 ranks x 2,000 steps), its report, Chromium's screenshot.
Generation is never timed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from benchmarks.synthetic_store import Spike, llama_names, write_store
from trainmon.tools.report import build


def write_csv_run(root: Path, modules: int, steps: int, metrics: list[str], seed: int = 0) -> int:
    """A one-rank CSV run; returns the number of CSV data rows written."""
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


def write_llama_store(root: Path, ranks: int, steps: int, families: list[str], steps_per_part: int = 1000) -> int:
    """The 7B-shape store of ``store`` and ``screenshot``; returns its rows."""
    spikes = [Spike(65, ".", 8.0, family=families[0]),
              Spike(steps * 3 // 5, r"layers\.12\.", 8.0, rank=min(3, ranks - 1), family=families[0])]
    nan_at = (steps * 3 // 4, "model.layers.20.mlp.down_proj.weight", min(5, ranks - 1))
    return write_store(root, llama_names(32), ranks=ranks, steps=steps, families=families,
                       steps_per_part=steps_per_part, spikes=spikes, nan_at=nan_at)


def link_copies(run: Path, copies: int, ranks: int) -> Path:
    """``run`` with ``copies`` times its ranks: the parts of rank R hard-linked under ranks R + k * ranks."""
    big = run.parent / f"{run.name}_x{copies}"
    for table in (run / "store").iterdir():
        for rank_dir in table.glob("rank=*"):
            rank = int(rank_dir.name[5:])
            for k in range(copies):
                target = big / "store" / table.name / f"rank={rank + k * ranks}"
                target.mkdir(parents=True, exist_ok=True)
                for part in rank_dir.iterdir():
                    os.link(part, target / part.name)
    for rank_dir in run.glob("rank*"):
        shutil.copytree(rank_dir, big / rank_dir.name)
    return big


def _timed_get(url: str) -> tuple[float, bytes]:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=600) as response:
        body = response.read()
    return time.perf_counter() - start, body


def time_serve(run: Path, label: str) -> None:
    """Print the times of serve's first view and of three drill-downs."""
    from trainmon.tools.serve import Server, open_views

    start = time.perf_counter()
    views = open_views(run)
    opened = time.perf_counter() - start
    server = Server(views, "127.0.0.1", 0)
    server.start()
    try:
        catalog = views.data["catalog"]
        family, metric, rank = (catalog["default"][key] for key in ("family", "metric", "rank"))
        page, _ = _timed_get(server.url)
        grid_time, body = _timed_get(f"{server.url}api/grid?view=steps&family={family}&metric={metric}&rank={rank}")
        grid = json.loads(body)
        first = opened + page + grid_time  # what the page asks for (the grid brings its rows)
        print(f"serve {label}: first view {first:.2f} s (open {opened:.2f} s: catalog, anomalies, curves; page "
              f"{page:.3f} s; module x step grid {grid['shape'][0]} x {grid['shape'][1]} with its rows "
              f"{grid_time:.2f} s)")
        last = catalog["families"][family]["last_step"]
        name = "0:model.layers.12.mlp.down_proj.weight"
        for what, path in (("drill-down to 11 steps", f"view=steps&family={family}&metric={metric}&rank={rank}"
                                                        f"&lo={last // 2}&hi={last // 2 + 10}"),
                           ("module x rank at a step", f"view=ranks&family={family}&metric={metric}&step={last // 2}"),
                           ("rank x step of a row", f"view=module&family={family}&metric={metric}&module={name}")):
            seconds, body = _timed_get(f"{server.url}api/grid?{path}")
            shape = json.loads(body)["shape"]
            print(f"serve {label}: {what}: {shape[0]} x {shape[1]} in {seconds:.2f} s")
    finally:
        server.stop()
        views.source.close()


def _peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    store = sub.add_parser("store")
    store.add_argument("--ranks", type=int, default=64)
    store.add_argument("--steps", type=int, default=5370)
    store.add_argument("--families", nargs="+", default=["grad_reduced"])
    store.add_argument("--copies", type=int, default=0, help="also serve a run of this many times the rows")
    store.add_argument("--dir", type=Path, default=None)
    csv = sub.add_parser("csv")
    csv.add_argument("--modules", type=int, default=1000)
    csv.add_argument("--steps", type=int, default=10_000)
    csv.add_argument("--metrics", nargs="+", default=["norm", "max"])
    csv.add_argument("--dir", type=Path, default=None)
    shot = sub.add_parser("screenshot")
    shot.add_argument("output", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=getattr(args, "dir", None)) as tmp:
        root = Path(tmp) / "run"
        started = time.perf_counter()
        if args.mode == "screenshot":
            return screenshot(root, args.output)
        if args.mode == "csv":
            rows = write_csv_run(root, args.modules, args.steps, args.metrics)
        else:
            rows = write_llama_store(root, args.ranks, args.steps, args.families)
        size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        print(f"wrote {rows:,} rows ({size / 1e6:.0f} MB) in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        out = Path(tmp) / "report.html"
        started, cpu = time.perf_counter(), time.process_time()
        summary = build(root, out, progress=False)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        print(f"report: {rows:,} rows -> {summary['heatmaps']} heatmaps, HTML of {summary['bytes'] / 1e6:.1f} MB in "
              f"{wall:.1f} s wall, {cpu:.1f} s CPU (peak RSS {_peak_gb():.1f} GB)")
        if args.mode == "store":
            time_serve(root, f"{rows:,} rows")
            if args.copies > 1:
                big = link_copies(root, args.copies, args.ranks)
                time_serve(big, f"{rows * args.copies:,} rows ({args.copies} hard-linked copies)")
    return 0


def screenshot(root: Path, output: Path) -> int:
    """The report of an 8-rank 7B-shape store (2,000 steps, three families) as headless Chromium draws it, cut to the
    heatmap section: rank 3's reduced gradients, where every row jumps x8 at step 65 and layer 12 at step 1,200."""
    from PIL import Image

    write_llama_store(root, 8, 2000, ["grad_reduced", "exp_avg", "exp_avg_sq"], steps_per_part=500)
    page = root / "report.html"
    build(root, page, progress=False)
    chromium = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)),
                    None)
    if chromium is None:
        print("no Chromium binary", file=sys.stderr)
        return 1
    tall = root.parent / "tall.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
                    f"--user-data-dir={root.parent / 'chromium'}", "--window-size=1400,3000", f"--screenshot={tall}",
                    page.resolve().as_uri() + "#view=steps&family=grad_reduced&metric=norm&rank=3"],
                   check=True, capture_output=True, timeout=300)
    image = Image.open(tall).convert("RGB")
    pixels = np.asarray(image)
    strip = np.all(pixels[:, 250:400] == (66, 133, 244), axis=2)  # the block strip's attention rows
    top = int(np.flatnonzero(strip.any(axis=1))[0])
    cut = image.crop((0, max(0, top - 185), 1400, min(image.height, top + 873 + 95)))
    cut.quantize(256, dither=Image.Dither.NONE).save(output)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
