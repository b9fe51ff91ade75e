"""Cost of the ``precursors`` family (docs/precursors.md): step time with it on against the ``weights`` tier.

    python benchmarks/precursor_cost.py [--steps 20] [--rounds 5] [--clock cpu|wall] [--device cpu|cuda]
                                        [--model gpt|1b] [--dtype float32|bfloat16]

Cases (alternating rounds, same seed and data; per case, the mean step of its best round):
  weights          weight grads + optimizer states (exp_avg, exp_avg_sq, update, ratio), 6 metrics, every step
  precursors       the same + optimizer_states.precursors, every step
  weights_10       `weights` collected every 10th step
  precursors_10    `precursors` collected every 10th step
The ratio that the target bounds is ``precursors_10 / weights_10`` (<= 1.01); ``precursors / weights`` is the cost
on a collected step alone, and ``1 + (precursors - weights) / 10 / weights_10`` its share every 10 steps (the same
figure without the noise of the 9 uncollected steps). The clock is the process's CPU time by default (all its
threads: the writers' too), which a noisy neighbour on a shared machine disturbs less than wall time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))
from tiny_gpt import TinyGPT, gpt_loss, make_batch  # noqa: E402

from benchmarks.overhead import DTYPES, METRICS6, MODELS  # noqa: E402

WEIGHTS = {"weight_grads": {"metrics": METRICS6}, "optimizer_states": {"metrics": METRICS6}}
PRECURSORS = {"weight_grads": {"metrics": METRICS6}, "optimizer_states": {"metrics": METRICS6, "precursors": True}}
CASES = {"weights": {**WEIGHTS}, "precursors": {**PRECURSORS},
         "weights_10": {**WEIGHTS, "step_interval": 10}, "precursors_10": {**PRECURSORS, "step_interval": 10}}
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
WARMUP = 2
"""Steps before the timed ones (0 and 1; with step_interval 10 the timed steps 2..21 hold the collected 10 and 20)."""


def _train(case: str, steps: int, device: str, out: str, clock: str, model_name: str, dtype: str) -> float:
    """The mean time of ``steps`` steps after the warm-up (a multiple of 10 holds every 10th step equally)."""
    from trainmon import TrainerMonitor

    shape, batch = MODELS[model_name]
    torch.manual_seed(0)
    with torch.device(device):
        model = TinyGPT(**shape).to(DTYPES[dtype])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    monitor = TrainerMonitor({"output_dir": out, "sinks": ["csv"], "anomaly": {"detectors": []}, **CASES[case]})
    monitor.attach(model, optimizer)
    total = 0.0
    for step in range(steps + WARMUP):
        tokens, targets = (t.to(device) for t in make_batch(step, batch, shape["seq"], shape["vocab"]))
        start = CLOCKS[clock]()
        loss = gpt_loss(model, tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        monitor.step(loss=loss)
        if device == "cuda":
            torch.cuda.synchronize()
        if step >= WARMUP:
            total += CLOCKS[clock]() - start
    monitor.close()
    return total / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round (a multiple of 10)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clock", choices=list(CLOCKS), default="cpu")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=list(MODELS), default="gpt")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    args = parser.parse_args()
    if args.steps % 10:
        parser.error("--steps must be a multiple of 10 (every 10th step is collected in the *_10 cases)")
    torch.set_num_threads(1)
    out = tempfile.mkdtemp(prefix="trainmon_precursors_")
    rounds: dict[str, list[float]] = {case: [] for case in args.cases}
    for _ in range(args.rounds):
        for case in args.cases:
            rounds[case].append(_train(case, args.steps, args.device, out, args.clock, args.model, args.dtype))
    best = {case: min(values) for case, values in rounds.items()}
    shape, batch = MODELS[args.model]
    params = sum(p.numel() for p in TinyGPT(**shape).to("meta").parameters())
    print(f"device {args.device}, torch {torch.__version__}, model {args.model} ({params / 1e6:.1f} M parameters, "
          f"{args.dtype}), batch {batch}, threads {torch.get_num_threads()}, clock {args.clock}, "
          f"{args.rounds} rounds x {args.steps} steps (best round's mean step)")
    print(f"{'case':<15} {'step ms':>9} {'rounds (ms)':>40}")
    for case in args.cases:
        spread = " ".join(f"{value * 1e3:.1f}" for value in rounds[case])
        print(f"{case:<15} {best[case] * 1e3:>9.2f} {spread:>40}")
    if "precursors" in best and "weights" in best:
        print(f"collected step, precursors / weights: {best['precursors'] / best['weights']:.4f}x "
              f"(+{(best['precursors'] - best['weights']) * 1e3:.2f} ms)")
    if "precursors_10" in best and "weights_10" in best:
        print(f"every 10th step collected, precursors_10 / weights_10: "
              f"{best['precursors_10'] / best['weights_10']:.4f}x (target <= 1.01x)")
    if len(best) == len(CASES):
        share = 1 + (best["precursors"] - best["weights"]) / 10 / best["weights_10"]
        print(f"every 10th step, from the collected step's cost: {share:.4f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
