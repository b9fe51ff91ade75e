"""Benchmark the grad probe's outputs: the per-file layout (CSV-only sinks) against the run store (``parquet``).

Usage: ``python benchmarks/grad_probe_store.py [--steps 200] [--level L2] [--dir DIR] [--keep]``

Trains the same small transformer (an embedding, 6 encoder layers of width 64, a head: 75 parameter tensors, 0.3 M
elements; AdamW, seeded) twice with the probe on every step, once with ``sinks: [csv]`` (``grad_summary.csv`` and a
``.bits`` file per parameter per step) and once with ``sinks: [parquet]`` (the ``grad_probe`` and
``grad_directions`` tables), and prints per layout: files, bytes (their sizes, and the disk space allocated for
them: a small file takes a whole block), the training loop's time, and ``trainmon grad-compare`` of the run with
itself. Then the alternative of one table holding the summary and the bits (``grad_probe`` joined with
``grad_directions``, written as the store writes a merged part): its bytes and files beside the two tables'.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

SINKS = {"files": ["csv"], "store": ["parquet"]}


def train(out: Path, name: str, sinks: list[str], steps: int, level: str) -> float:
    """One run with the probe on every step; returns the training loop's seconds (close included)."""
    import torch

    from trainmon import TrainerMonitor

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Embedding(100, 64), torch.nn.TransformerEncoder(layer, 6),
                                torch.nn.Linear(64, 100))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {"output_dir": str(out), "run_name": name, "sinks": sinks, "weight_grads": {"enabled": False},
              "optimizer_states": {"enabled": False}, "grad_probe": {"enabled": True, "level": level}}
    generator = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer)
        for _ in range(steps):
            tokens = torch.randint(0, 100, (4, 16), generator=generator)
            loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(loss=loss)
    return time.perf_counter() - start


def probe_files(run: Path) -> list[Path]:
    """The probe's files of a run: ``rank*/grad_probe/**`` or the store's two tables."""
    found = [p for p in run.glob("rank*/grad_probe/**/*") if p.is_file()]
    for table in ("grad_probe", "grad_directions"):
        found += [p for p in (run / "store" / table).rglob("*") if p.is_file()]
    return found


def sizes(paths: list[Path]) -> tuple[int, int]:
    """Bytes of the files, and bytes allocated for them on disk."""
    stats = [p.stat() for p in paths]
    return sum(s.st_size for s in stats), sum(s.st_blocks * 512 for s in stats)


def compare_seconds(run: Path, out: Path) -> float:
    """``trainmon grad-compare RUN RUN`` in a fresh process (the command as a user runs it): its seconds."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "trainmon", "grad-compare", str(run), str(run), "-o", str(out),
                    "--no-plots"], check=True, capture_output=True, env=env)
    return time.perf_counter() - start


def one_table(run: Path, out: Path) -> tuple[int, int]:
    """Bytes and files of the alternative: summary and bits in one table, one merged part per rank."""
    import pyarrow.parquet as pq

    from trainmon.probe.store import ROW_GROUP_BYTES
    from trainmon.sinks.store_layout import parquet_bytes
    from trainmon.tools.store import open_run

    with open_run(run) as con:
        joined = con.sql("SELECT s.*, d.dtype, d.count, d.sample, d.first, d.bits FROM grad_probe s JOIN "
                         "grad_directions d USING (rank, step, vpp_stage, name) ORDER BY s.step").to_arrow_table()
    joined = joined.drop_columns(["rank"])
    data = parquet_bytes(joined, 3, row_group_bytes=ROW_GROUP_BYTES)
    (out / "one_table.parquet").write_bytes(data)
    assert pq.read_metadata(out / "one_table.parquet").num_rows == joined.num_rows
    return len(data), 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--level", default="L2", choices=("L1", "L2"))
    parser.add_argument("--dir", type=Path, default=None, help="where to write the runs (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the runs")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        for layout, sinks in SINKS.items():
            seconds = train(root, layout, sinks, args.steps, args.level)
            files = probe_files(root / layout)
            apparent, allocated = sizes(files)
            compare = compare_seconds(root / layout, root / f"compare_{layout}")
            print(f"{layout:>5} (sinks {sinks}): {len(files):,} files, {apparent / 1e6:.2f} MB "
                  f"({allocated / 1e6:.2f} MB allocated on disk); training loop {seconds:.1f} s for {args.steps} "
                  f"steps; grad-compare of the run with itself {compare:.2f} s", flush=True)
        store = root / "store" / "store"
        for table in ("grad_probe", "grad_directions"):
            paths = [p for p in (store / table).rglob("*.parquet")]
            print(f"  table {table}: {len(paths)} file(s), {sizes(paths)[0] / 1e6:.3f} MB")
        from trainmon.tools.store import open_run

        with open_run(root / "store") as con:
            (payload,), = con.execute("SELECT sum(octet_length(bits)) FROM grad_directions").fetchall()
        print(f"  the packed signs themselves: {payload / 1e6:.3f} MB")
        together, files = one_table(root / "store", root)
        print(f"  alternative, one table with summary and bits: {files} file(s), {together / 1e6:.3f} MB")
        same = (root / "compare_files" / "similarities.csv").read_text() == \
            (root / "compare_store" / "similarities.csv").read_text()
        print(f"grad-compare gives the same similarities.csv on both layouts: {same}")
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
