"""Overhead of trainmon on a MindSpore network in PyNative mode: step time against no monitor.

    python benchmarks/mindspore_overhead.py [--steps 8] [--rounds 3] [--clock wall|cpu] [--profile CASE]

A small real model (an MLP of ``LAYERS`` ``nn.Dense(WIDTH, WIDTH)`` + ReLU and a ``nn.Dense(WIDTH, 10)``
head, batch ``BATCH``, ``nn.Adam``) trained the way the MindSpore docs train it: ``mindspore.value_and_grad``
and ``optimizer(grads)``, on the CPU. Every step is collected except in ``uncollected``. Cases:
  none          no monitor (every case reads the loss back each step, as a loop that logs it does)
  weights       the default families: weight gradients (unreduced, reduced) and optimizer states
                (exp_avg, exp_avg_sq, update, ratio), every metric
  activations   weights + every cell's activations and activation gradients
  forward_activations  weights + every cell's activations, without their gradients (no cell backward hooks)
  uncollected   activations, with ``step_interval: 100``: the steps measured are not collected
  guard         the step guard on (``anomaly.guard.enabled: true``, its default rules), nothing collected: what
                the guard's decision adds to a step (its norms, one host read, the rules)
  guard_off     the same monitor without the guard (nothing collected)
The method is ``benchmarks/overhead.py``'s: 2 warm-up steps, rounds alternate the cases (same seed and
data), per case the median step of each round, then the best round, so a noisy neighbour on a shared
machine does not decide the ratio. ``--profile CASE`` prints cProfile's top entries for that case instead.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYERS, WIDTH, BATCH = 4, 256, 64
CASES: dict[str, dict[str, Any] | None] = {
    "none": None,
    "weights": {},
    "activations": {"activations": {"enabled": True}},
    "forward_activations": {"activations": {"enabled": True, "backward": False}},
    "uncollected": {"activations": {"enabled": True}, "step_interval": 100, "start_step": 1},
    "guard": {"anomaly": {"detectors": [], "guard": {"enabled": True}}, "step_interval": 100, "start_step": 1},
    "guard_off": {"step_interval": 100, "start_step": 1},
}
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _network() -> Any:
    from mindspore import nn

    class Mlp(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.CellList([nn.Dense(WIDTH, WIDTH) for _ in range(LAYERS)])
            self.act = nn.ReLU()
            self.head = nn.Dense(WIDTH, 10)

        def construct(self, x: Any) -> Any:
            for layer in self.layers:
                x = self.act(layer(x))
            return self.head(x)

    return Mlp()


def _train(case: str, steps: int, out: str, clock: str, profile: cProfile.Profile | None = None) -> list[float]:
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, nn

    from trainmon import TrainerMonitor

    ms.set_seed(0)
    net = _network()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=1e-3)
    loss_fn = nn.MSELoss()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, optimizer.parameters)
    monitor = None
    config = CASES[case]
    if config is not None:
        monitor = TrainerMonitor({"output_dir": out, "sinks": ["csv"], "anomaly": {"detectors": []}, **config})
        monitor.attach(net, optimizer)
    rng = np.random.default_rng(0)
    data = [(Tensor(rng.standard_normal((BATCH, WIDTH)).astype(np.float32)),
             Tensor(rng.standard_normal((BATCH, 10)).astype(np.float32))) for _ in range(4)]
    times = []
    for step in range(steps + 2):  # 2 warm-up steps
        x, y = data[step % len(data)]
        if profile is not None and step == 2:
            profile.enable()
        start = CLOCKS[clock]()
        loss, grads = grad_fn(x, y)
        optimizer(grads)
        if monitor is not None:
            monitor.step(loss=loss)
        float(loss.asnumpy())  # the loop reads its loss every step (after the monitor's transfer: no wait)
        if step >= 2:
            times.append(CLOCKS[clock]() - start)
    if profile is not None:
        profile.disable()
    if monitor is not None:
        monitor.close()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="wall: elapsed time; cpu: this process's CPU time (all threads), for shared machines")
    parser.add_argument("--profile", choices=list(CASES), help="print cProfile's top entries for one case")
    parser.add_argument("--sort", default="tottime", help="cProfile sort key with --profile")
    args = parser.parse_args()
    import mindspore as ms

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    out = tempfile.mkdtemp(prefix="trainmon_ms_bench_")
    if args.profile:
        profile = cProfile.Profile()
        _train(args.profile, args.steps, out, args.clock, profile)
        pstats.Stats(profile).sort_stats(args.sort).print_stats(30)
        return 0
    cases = ["none", *(c for c in args.cases if c != "none")]
    rounds: dict[str, list[float]] = {case: [] for case in cases}
    for _ in range(args.rounds):  # alternate: drift and a noisy neighbour hit every case alike
        for case in cases:
            rounds[case].append(statistics.median(_train(case, args.steps, out, args.clock)))
    best = {case: min(values) for case, values in rounds.items()}
    print(f"MindSpore {ms.__version__} PyNative on CPU, MLP {LAYERS}x{WIDTH}, batch {BATCH}, nn.Adam, "
          f"clock {args.clock}, {args.rounds} rounds x {args.steps} steps (best round's median)")
    print(f"{'case':<20} {'step ms':>9} {'ratio':>8}   rounds' medians (ms)")
    for case in cases:
        spread = " ".join(f"{value * 1e3:.1f}" for value in rounds[case])
        print(f"{case:<20} {best[case] * 1e3:>9.1f} {best[case] / best['none']:>7.2f}x   {spread}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
