"""Bytes a real DDP run writes with and without ``write_replicated_once`` (docs/sizing.md), against the projection.

Usage: ``python benchmarks/replicated_once.py [--ranks 2] [--steps 200] [--sinks parquet]``

Trains the README demo's TinyGPT (53 parameter tensors, AdamW, the default config) under torch DDP on ``--ranks``
local gloo processes, twice (the key on, then off), and prints per run: the bytes in the run directory (the sinks'
files: ``store/`` and the ``rank*/`` CSV and TensorBoard files; not ``run.json``), the rows per family (``trainmon
query``'s views, which give every rank its rows in both runs), and the projection ``run.json`` holds for the same
steps (``bytes_per_1000_steps_all_ranks``, scaled to ``--steps``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SINK_FILES = ("*.csv", "events.out.tfevents.*", "*.parquet")


def train(out: str, steps: int, sinks: list[str]) -> None:
    """One rank: both runs (``once``, ``every``)."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples"))
    from tiny_gpt import TinyGPT

    from trainmon import TrainerMonitor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        for run_name, once in (("once", True), ("every", False)):
            torch.manual_seed(0)
            model = torch.nn.parallel.DistributedDataParallel(TinyGPT(vocab=128, d=64, layers=4, heads=4, seq=32))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            monitor = TrainerMonitor({"output_dir": out, "run_name": run_name, "sinks": sinks,
                                      "write_replicated_once": once})
            monitor.attach(model, optimizer)
            generator = torch.Generator().manual_seed(rank)
            for _ in range(steps):
                tokens = torch.randint(0, 128, (4, 33), generator=generator)
                logits = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), tokens[:, 1:].reshape(-1))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                monitor.step(loss=loss)
            monitor.close()
    finally:
        dist.destroy_process_group()


def launch(ranks: int, out: Path, steps: int, sinks: list[str]) -> None:
    port = 29500 + os.getpid() % 1000
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(ranks), "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(out), str(steps), ",".join(sinks)],
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in range(ranks)]
    if any(proc.wait() for proc in procs):
        raise SystemExit("a rank failed")


def measure(run: Path, steps: int) -> tuple[int, float, int, list[str]]:
    """``(bytes written, bytes projected for those steps, rows read back, families written once)`` of a run."""
    written = sum(path.stat().st_size for pattern in SINK_FILES for path in run.rglob(pattern))
    info = json.loads((run / "run.json").read_text())
    rows = 0
    if (run / "store").is_dir():
        from trainmon.tools.store import open_run

        con = open_run(run)
        for family in info["sizing"]["rows_per_collected_step"]:
            rows += con.execute(f"SELECT count(*) FROM {family}").fetchone()[0]
        con.close()
    projected = info["sizing"]["bytes_per_1000_steps_all_ranks"] * steps / 1000
    return written, projected, rows, info["replicated"]["families"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sinks", nargs="+", default=["parquet"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        launch(args.ranks, Path(tmp), args.steps, args.sinks)
        results = {name: measure(Path(tmp) / name, args.steps) for name in ("once", "every")}
    print(f"TinyGPT, DDP on {args.ranks} gloo ranks, {args.steps} steps, sinks {args.sinks}")
    print("| write_replicated_once | bytes written | projected at attach | rows read back (every rank) |")
    print("|---|---|---|---|")
    for name, key in (("every", "false"), ("once", "true")):
        written, projected, rows, _ = results[name]
        print(f"| {key} | {written:,} | {projected:,.0f} | {f'{rows:,}' if rows else '-'} |")
    print(f"\nonce / every: {results['once'][0] / results['every'][0]:.3f} (bytes written); "
          f"families written once: {', '.join(results['once'][3])}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        train(sys.argv[2], int(sys.argv[3]), sys.argv[4].split(","))
    else:
        main()
