"""Benchmark ``trainmon analyse``: 1,024 ranks x 1,000 events each must merge in under 10 s.

Usage: ``python benchmarks/analyse_scale.py [--ranks 1024] [--events 1000] [--dir DIR]``.
Writes a synthetic run (messages of about 300 characters, as the detectors write them; one corrupt
line), times :func:`analyse_run` and checks the first
origin it finds. Prints ``analyse: N events from R files in T s``.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import time
from pathlib import Path

from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.merge import analyse_run

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--events", type=int, default=1000)
    parser.add_argument("--dir", default=None, help="reuse/keep the synthetic run here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.dir or tmp) / "run"
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
