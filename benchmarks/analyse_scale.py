"""Benchmark ``trainmon analyse``: 1,024 ranks x 1,000 events each must merge in under 10 s (the JSON reader);
``--store``: the same command in SQL over a run's store, at 10^7-10^8 events and rows.

Usage: ``python benchmarks/analyse_scale.py [--ranks 1024] [--events 1000] [--dir DIR]``.
Writes a synthetic run (messages of about 300 characters, as the detectors write them; one corrupt
line), times :func:`analyse_run` and checks the first
origin it finds. Prints ``analyse: N events from R files in T s``.

``python benchmarks/analyse_scale.py --store [--ranks 64] [--store-events 10000000] [--store-rows 10000000]
[--dir DIR]`` writes a synthetic store directly with pyarrow (as the Parquet sink lays it out: one events file and
one part per table and rank; events with ~300-character messages, rows of ``actv`` and ``grad_reduced`` with the 7
default metrics, a NaN entering on one rank mid-run, one rank whose norms are off in 1 group of 100), then runs
``trainmon analyse RUN`` in a fresh process and prints its wall time and peak memory, and the time of the events
part and the rows part alone (:func:`~trainmon.tools.store_analyse.analyse_store`, in that process), checking the
answers (the planted first origin, the planted non-finite row, the deviating rank first).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.merge import analyse_run
from trainmon.sinks.store_events import EVENT_SCHEMA
from trainmon.sinks.store_layout import parquet_bytes, part_name
from trainmon.tools.store import open_run
from trainmon.tools.store_analyse import analyse_store, connect, row_sections

PHASES = ("forward", "backward", "optimizer")
FAMILY = {"forward": "actv", "backward": "actv_grad", "optimizer": "grad_reduced"}


def _message(step: int, rank: int, phase: str, family: str, name: str, value: float) -> str:
    """A message as long as the detectors write (about 300 characters)."""
    return (f"spike: {phase} output of {name} (norm) at step {step}, micro-step 0, rank {rank} is "
            f"{value:.4g}, baseline 1 (z={value * 3.7:.4g}, threshold 6); {family}/{name} norm={value:.4g}; "
            f"{int(value) % 17} more values out of band later in this step (actv {int(value) % 5}, "
            f"actv_grad {int(value) % 7}, grad_reduced {int(value) % 11}, exp_avg 0, update 0, ratio 0)")


def write_run(root: Path, ranks: int, events: int, seed: int = 0) -> None:
    """Synthetic run: every rank has ``events`` events; rank ranks//2 has the first origin at step 0."""
    rng = random.Random(seed)
    for rank in range(ranks):
        rank_dir = root / f"rank{rank}"
        rank_dir.mkdir(parents=True)
        lines = []
        for i in range(events):
            step = 1 + i // 4
            phase = PHASES[i % 3]
            name = f"layers.{i % 24}.mlp.output"
            value = rng.random() * 100
            event = AnomalyEvent(step=step, micro_step=0, rank=rank, phase=phase, family=FAMILY[phase],
                                 name=name, metric="norm", value=value, baseline=1.0, detector="spike",
                                 message=_message(step, rank, phase, FAMILY[phase], name, value), order=i % 97,
                                 pp_stage=rank % 4, vpp_stage=0, time="2026-01-01T00:00:00.000Z")
            lines.append(event.to_json())
        if rank == ranks // 2:
            lines.append(AnomalyEvent(0, 0, rank, "forward", "actv", "layers.2.mlp.output", "nans", 4.0, 0.0,
                                      "nonfinite", "first", 7, rank % 4, 0, "2026-01-01T00:00:00.000Z").to_json())
            lines.append('{"step": 3, "broken')
        (rank_dir / "anomalies.jsonl").write_text("\n".join(lines) + "\n")


TENSORS = 292
"""Rows per step and rank in the store (half ``actv``, half ``grad_reduced``), as in benchmarks/store_scale.py."""
DEVIANT_RANK = 7


def _events_table(rank: int, count: int, rng: np.random.Generator) -> pa.Table:
    """``count`` events of one rank, earliest first, with messages as long as the detectors write."""
    index = np.arange(count)
    step = 1 + index // 8
    phases = np.array(PHASES)[index % 3]
    names = pa.array(np.char.add("layers.", (index % 24).astype(str)).astype(object)).cast(pa.string())
    names = pc.binary_join_element_wise(names, pa.scalar(".mlp.output"), "")
    value = rng.random(count) * 100
    steps = pa.array(step).cast(pa.string())
    values = pc.round(pa.array(value), 3).cast(pa.string())
    phase = pa.array(phases.astype(object), pa.string())
    message = pc.binary_join_element_wise(
        "spike: ", phase, " output of ", names, " (norm) at step ", steps, f", micro-step 0, rank {rank} is ", values,
        ", baseline 1 (z=", values, ", threshold 6); more values out of band later in this step (actv 3, actv_grad"
        " 5, grad_reduced 2, exp_avg 0, update 0, ratio 0); the spike detector's series grad_reduced/*/norm", "")
    families = np.array([FAMILY[p] for p in PHASES])[index % 3]
    return pa.table({
        "step": pa.array(step, pa.int64()), "micro_step": pa.array(np.zeros(count, np.int32)), "phase": phase,
        "pp_stage": pa.array(np.zeros(count, np.int32)), "vpp_stage": pa.array(np.zeros(count, np.int32)),
        "order": pa.array((index % 97).astype(np.int32)), "detector": pa.array(["spike"] * count, pa.string()),
        "family": pa.array(families.astype(object), pa.string()), "name": names,
        "metric": pa.array(["norm"] * count, pa.string()), "value": pa.array(value),
        "baseline": pa.array(np.ones(count)), "message": message,
        "time": pa.array(["2026-01-01T00:00:00.000Z"] * count, pa.string())}, schema=EVENT_SCHEMA)


def _rows_table(family: str, rank: int, ranks: int, steps: int, rng: np.random.Generator,
                base: np.ndarray) -> pa.Table:
    """One rank's rows of one family for ``steps`` steps (``TENSORS // 2`` tensors each)."""
    half = TENSORS // 2
    step = np.repeat(np.arange(steps, dtype=np.int64), half)
    tensor = np.tile(np.arange(half), steps)
    norm = base[tensor] * np.exp(rng.normal(0, 0.05, len(step)))
    if rank == DEVIANT_RANK % ranks:
        norm = np.where(rng.random(len(step)) < 0.01, norm * 3, norm)
    nonfinite = np.zeros(len(step), dtype=bool)
    if rank == ranks // 3:  # a NaN enters at one tensor mid-run and spreads to the later rows of that step
        nonfinite = (step == steps // 2) & (tensor >= half // 2) if family == "actv" else (step == steps // 2)
    norm = np.where(nonfinite, np.nan, norm)
    prefix = "model.layers." if family == "actv" else "model.params."
    names = pa.DictionaryArray.from_arrays(pa.array(tensor.astype(np.int32)),
                                           pa.array([f"{prefix}{i}.output" for i in range(half)]))
    return pa.table({
        "step": pa.array(step), "micro_step": pa.array(np.zeros(len(step), np.int32)),
        "vpp_stage": pa.array(np.zeros(len(step), np.int32)),
        "pp_stage": pa.array(np.zeros(len(step), np.int32)),
        "order": pa.array((tensor + (0 if family == "actv" else half)).astype(np.int32)),
        "phase": pa.array(["forward" if family == "actv" else "optimizer"] * len(step), pa.string()),
        "name": names.cast(pa.string()), "nonfinite": pa.array(nonfinite),
        "norm": pa.array(norm), "min": pa.array(-norm / 7), "max": pa.array(norm / 5), "mean": pa.array(norm / 1e4),
        "zeros": pa.array(np.zeros(len(step))), "nans": pa.array(np.where(nonfinite, 4.0, 0.0)),
        "infs": pa.array(np.zeros(len(step)))})


def write_store(root: Path, ranks: int, events: int, rows: int, seed: int = 0) -> None:
    """The synthetic store (see the module); rank ``ranks // 2`` has the first origin, a non-finite event at step 0.

    Every rank gets the same events (one file's bytes, written once per rank: making 10^8 distinct messages would
    take longer than analysing them); the rows differ by rank."""
    rng = np.random.default_rng(seed)
    steps = max(1, rows // (ranks * TENSORS))
    bases = {family: np.exp(rng.normal(np.log(0.1), 1.5, TENSORS // 2)) for family in ("actv", "grad_reduced")}
    shared = _events_table(0, events // ranks, rng)
    shared_bytes = parquet_bytes(shared, compression_level=1)
    for rank in range(ranks):
        data = shared_bytes
        if rank == ranks // 2:
            first = AnomalyEvent(0, 0, rank, "forward", "actv", "layers.2.mlp.output", "nans", 4.0, 0.0, "nonfinite",
                                 "first", 7, 0, 0, "2026-01-01T00:00:00.000Z").to_dict()
            first.pop("rank")
            data = parquet_bytes(pa.concat_tables([shared, pa.Table.from_pylist([first], schema=EVENT_SCHEMA)]),
                                 compression_level=1)
        directory = root / "store" / "anomalies" / f"rank={rank}"
        directory.mkdir(parents=True)
        end = 400 * (events // ranks + 1)  # the byte range it would have had in anomalies.jsonl
        (directory / f"events-{0:015d}-{end:015d}.parquet").write_bytes(data)
        for family, base in bases.items():
            directory = root / "store" / family / f"rank={rank}"
            directory.mkdir(parents=True)
            part = _rows_table(family, rank, ranks, steps, rng, base)
            (directory / part_name(0, steps - 1, "00000000", 0, 0)).write_bytes(parquet_bytes(part, 1))


def _store(args: argparse.Namespace, root: Path) -> int:
    ranks = args.ranks or 64
    if not root.exists():
        t0 = time.perf_counter()
        write_store(root, ranks, args.store_events, args.store_rows)
        size = sum(p.stat().st_size for p in root.rglob("*.parquet"))
        print(f"wrote a store of {ranks} ranks, {args.store_events} events and {args.store_rows} rows "
              f"({size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s")
    out = root.parent / "analysed.json"
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "trainmon", "analyse", str(root), "-o", str(out)],
                          capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    assert done.returncode == 0, done.stderr
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    result = json.loads(out.read_text())
    print(f"trainmon analyse (SQL): {result['events']} events, {result['files']} ranks, rows of {ranks} ranks in "
          f"{elapsed:.1f} s wall, peak {peak:.0f} MB")
    first, row = result["first_origin"], result["first_nonfinite_row"]
    assert (first["rank"], first["step"], first["detector"]) == (ranks // 2, 0, "nonfinite"), first
    assert (row["rank"], row["family"]) == (ranks // 3, "actv"), row
    assert result["deviating_ranks"]["ranks"][0]["rank"] == DEVIANT_RANK % ranks, result["deviating_ranks"]
    t0 = time.perf_counter()
    analyse_store(root, rows=False)
    events_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    with connect() as con:
        open_run(root, connection=con)
        row_sections(con)
    print(f"  events part {events_seconds:.1f} s, rows part {time.perf_counter() - t0:.1f} s (in this process)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=None, help="1024 (64 with --store)")
    parser.add_argument("--events", type=int, default=1000, help="events per rank (the JSON reader)")
    parser.add_argument("--store", action="store_true", help="time analyse in SQL over a synthetic store")
    parser.add_argument("--store-events", type=int, default=10**7, help="events in all (--store)")
    parser.add_argument("--store-rows", type=int, default=10**7, help="rows in all (--store)")
    parser.add_argument("--dir", default=None, help="reuse/keep the synthetic run here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.dir or tmp) / "run"
        if args.store:
            return _store(args, root)
        args.ranks = args.ranks or 1024
        if not root.exists():
            t0 = time.perf_counter()
            write_run(root, args.ranks, args.events)
            print(f"wrote {args.ranks} x {args.events} events in {time.perf_counter() - t0:.1f} s")
        t0, cpu0 = time.perf_counter(), time.process_time()
        result = analyse_run(root, top=20)
        elapsed = time.perf_counter() - t0
        print(f"analyse: {result['events']} events from {result['files']} files in {elapsed:.2f} s wall, "
              f"{time.process_time() - cpu0:.2f} s CPU")
        first = result["first_origin"]
        assert first["rank"] == args.ranks // 2 and first["step"] == 0, first
        assert result["corrupt_total"] == 1 and result["corrupt"][0]["line"] == args.events + 2, result["corrupt"]
        assert math.isfinite(elapsed)
    return 0 if elapsed < 10 else 1


if __name__ == "__main__":
    sys.exit(main())
