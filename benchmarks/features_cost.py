"""Cost of the model features (docs/features.md) on a small GPT on the CPU: the weights tier with and without them.

    python benchmarks/features_cost.py [--steps 60] [--rounds 3] [--interval 10] [--clock cpu|wall]

Cases (same seed and data, rounds alternating the cases; per case the best round):
  weights    weight grads + optimizer states (exp_avg, exp_avg_sq, update, ratio), 6 metrics, every 10th step
  features   the same + features.attention (64 query rows, every head) and features.weights (2 power iterations
             of every matrix) on those steps
Reported: the mean time of all steps (the cost a run sees: 1 collected step in 10), the median collected step, and
the amortised ratio (1 + the collected steps' difference / interval / the mean step: the uncollected steps run the
same code in both cases, so this excludes their noise). Target (4-layer d=256, batch 8, seq 128, 1 thread):
features / weights <= 1.01.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))
from tiny_gpt import TinyGPT, gpt_loss, make_batch  # noqa: E402

METRICS6 = ["norm", "min", "max", "mean", "nans", "infs"]
WEIGHTS = {"weight_grads": {"metrics": METRICS6}, "optimizer_states": {"metrics": METRICS6}}
CASES = {
    "weights": WEIGHTS,
    "features": {**WEIGHTS, "features": {"attention": {"enabled": True}, "weights": {"enabled": True}}},
}
SHAPE, BATCH = dict(vocab=1024, d=256, layers=4, heads=4, seq=128), 8
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def train(case: str, steps: int, interval: int, out: str, clock: str) -> tuple[list[float], list[float]]:
    """``(every step's time, the collected steps' times)`` after 2 warm-up steps."""
    from trainmon import TrainerMonitor

    torch.manual_seed(0)
    model = TinyGPT(**SHAPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    monitor = TrainerMonitor({"output_dir": out, "sinks": ["csv"], "anomaly": {"detectors": []},
                              "step_interval": interval, **CASES[case]})
    monitor.attach(model, optimizer)
    times, collected = [], []
    for step in range(steps + 2):
        tokens, targets = make_batch(step, BATCH, SHAPE["seq"], SHAPE["vocab"])
        start = CLOCKS[clock]()
        loss = gpt_loss(model, tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        monitor.step(loss=loss)
        elapsed = CLOCKS[clock]() - start
        if step >= 2:
            times.append(elapsed)
            if step % interval == 0:
                collected.append(elapsed)
    monitor.close()
    return times, collected


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interval", type=int, default=10, help="step_interval of both cases")
    parser.add_argument("--clock", choices=list(CLOCKS), default="cpu",
                        help="cpu: this process's CPU time (for a shared machine); wall: elapsed time")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = tempfile.mkdtemp(prefix="trainmon_features_")
    means: dict[str, list[float]] = {case: [] for case in CASES}
    collected: dict[str, list[float]] = {case: [] for case in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            every, on = train(case, args.steps, args.interval, out, args.clock)
            means[case].append(statistics.mean(every))
            collected[case].append(statistics.median(on))
    best = {case: min(values) for case, values in means.items()}
    best_collected = {case: min(values) for case, values in collected.items()}
    params = sum(p.numel() for p in TinyGPT(**SHAPE).parameters())
    print(f"cpu, torch {torch.__version__}, model {SHAPE} ({params / 1e6:.1f} M parameters), batch {BATCH}, "
          f"1 thread, clock {args.clock}, step_interval {args.interval}, {args.rounds} rounds x {args.steps} steps")
    print(f"{'case':<10} {'mean step ms':>13} {'collected step ms':>18}")
    for case in CASES:
        print(f"{case:<10} {best[case] * 1e3:>13.1f} {best_collected[case] * 1e3:>18.1f}")
    extra = best_collected["features"] - best_collected["weights"]
    print(f"features / weights: {best['features'] / best['weights']:.4f}x over all steps (measured), "
          f"{best_collected['features'] / best_collected['weights']:.3f}x on the collected steps "
          f"(+{extra * 1e3:.1f} ms each)")
    # the uncollected steps are the same in both cases: their noise is all the measured ratio holds beyond this
    print(f"amortised: 1 + {extra * 1e3:.1f} ms / {args.interval} steps / {best['weights'] * 1e3:.1f} ms = "
          f"{1 + extra / args.interval / best['weights']:.4f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
