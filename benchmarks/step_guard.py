"""Step-time cost of the step guard (``anomaly.guard``) on a small GPT: guard on against no monitor.

    python benchmarks/step_guard.py [--steps 8] [--rounds 5] [--device cpu|cuda] [--model gpt|1b]

Cases (alternating rounds, same seed and data; per case, the median step of its best round):
  {fused,foreach}_none    AdamW(fused=True) / AdamW(foreach=True), no monitor
  {fused,foreach}_guard   the same with a monitor that collects nothing (step_interval 1000, from step 1) and the
                          step guard on (its defaults: non-finite and a 6-sigma z-score over 128 steps): the fused
                          optimizer takes the verdict as its device flag, the foreach one reads it on the host
Also timed: the guard's decision itself (its ``_decide``: norms, rules, history), per step. Target (4-layer d=256 on
one CPU thread): guard <= 1.05x its optimizer without a monitor.
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

from benchmarks.overhead import MODELS  # noqa: E402

CASES = ("fused_none", "fused_guard", "foreach_none", "foreach_guard")


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
DECIDE: list[float] = []
"""Time spent in the guard's decision (its norms, rules and history), per call, on the clock in use."""


def _timed_decide(clock: str) -> None:
    """Time the guard's own part of the step (its ``_decide``) besides the whole step."""
    from trainmon.collect.step_guard import StepGuard

    decide = StepGuard._decide

    def timed(self: StepGuard) -> object:
        start = CLOCKS[clock]()
        try:
            return decide(self)
        finally:
            DECIDE.append(CLOCKS[clock]() - start)

    StepGuard._decide = timed  # type: ignore[method-assign]


def _train(case: str, steps: int, device: str, out: str, model_name: str, clock: str) -> list[float]:
    from trainmon import TrainerMonitor

    shape, batch = MODELS[model_name]
    torch.manual_seed(0)
    with torch.device(device):
        model = TinyGPT(**shape)
    kind, guard = case.split("_")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **{kind: True})  # type: ignore[arg-type]
    monitor = None
    if guard == "guard":
        monitor = TrainerMonitor({"output_dir": out, "sinks": ["csv"], "step_interval": 1000, "start_step": 1,
                                  "anomaly": {"detectors": [], "guard": {"enabled": True}}})
        monitor.attach(model, optimizer)
    times = []
    for step in range(steps + 2):  # 2 warm-up steps
        tokens, targets = (t.to(device) for t in make_batch(step, batch, shape["seq"], shape["vocab"]))
        start = CLOCKS[clock]()
        loss = gpt_loss(model, tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if monitor is not None:
            monitor.step(loss=loss)
        if device == "cuda":
            torch.cuda.synchronize()
        if step >= 2:
            times.append(CLOCKS[clock]() - start)
    if monitor is not None:
        monitor.close()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=list(MODELS), default="gpt")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="wall: elapsed time; cpu: this process's CPU time, for shared machines")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _timed_decide(args.clock)
    out = tempfile.mkdtemp(prefix="trainmon_bench_")
    rounds: dict[str, list[float]] = {case: [] for case in CASES}
    for _ in range(args.rounds):  # alternate the cases so that drift hits all alike; the best round counts
        for case in CASES:
            rounds[case].append(statistics.median(_train(case, args.steps, args.device, out, args.model,
                                                         args.clock)))
    best = {case: min(values) for case, values in rounds.items()}
    print(f"device {args.device}, torch {torch.__version__}, model {args.model} {MODELS[args.model][0]}, "
          f"threads {torch.get_num_threads()}, clock {args.clock}, {args.rounds} rounds x {args.steps} steps "
          f"(best round's median)")
    print(f"{'case':<15} {'step ms':>9} {'ratio':>8}")
    for case in CASES:
        base = best[case.split("_")[0] + "_none"]
        print(f"{case:<15} {best[case] * 1e3:>9.1f} {best[case] / base:>7.3f}x")
    print(f"the guard's decision (norms, rules, history): median {statistics.median(DECIDE) * 1e3:.2f} ms per step "
          f"over {len(DECIDE)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
