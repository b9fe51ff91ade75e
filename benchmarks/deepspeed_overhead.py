"""Overhead of trainmon on a DeepSpeed engine (one rank): step time against no monitor.

    DS_ACCELERATOR=cpu python benchmarks/deepspeed_overhead.py [--steps 8] [--rounds 3] [--stages 0 3]

The model, batch and monitor configs are those of ``benchmarks/overhead.py`` (its ``SHAPE``,
``BATCH`` and ``CASES``; the tiny GPT of ``examples/tiny_gpt.py``), trained by a fp32 DeepSpeed
engine (AdamW, ``torch_adam``) under ZeRO-3 and, for reference, ZeRO-0. Cases per stage:
  none      no monitor
  weights   weight grads (unreduced and reduced) + optimizer states, 6 metrics, every step
The method mirrors overhead.py: 2 warm-up steps, rounds alternate the cases (same seed and data),
per case the median step of each round, then the best round. One rank, so the shard statistics
need no collective: the figure is the cost of the hooks, the shard reads and the one host transfer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))
from launch_env import single_process_env  # noqa: E402

single_process_env()

import torch  # noqa: E402
from tiny_gpt import TinyGPT, gpt_loss, make_batch  # noqa: E402

from benchmarks.overhead import BATCH, CASES, CLOCKS, SHAPE  # noqa: E402

DS_CASES = ("none", "weights")


def _train(stage: int, case: str, steps: int, out: str, clock: str) -> list[float]:
    import deepspeed

    from trainmon import TrainerMonitor

    torch.manual_seed(0)
    model = TinyGPT(**SHAPE)
    config = {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": {"stage": stage},
              "steps_per_print": 10 ** 6, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    monitor = None
    if CASES[case] is not None:
        monitor = TrainerMonitor({"output_dir": out, "sinks": ["csv"], "anomaly": {"detectors": []}, **CASES[case]})
        monitor.attach(engine)
    times = []
    for step in range(steps + 2):  # 2 warm-up steps
        tokens, targets = make_batch(step, BATCH, SHAPE["seq"], SHAPE["vocab"])
        start = CLOCKS[clock]()
        loss = gpt_loss(engine, tokens, targets)
        engine.backward(loss)
        engine.step()
        if monitor is not None:
            monitor.step(loss=loss)
        if step >= 2:
            times.append(CLOCKS[clock]() - start)
    if monitor is not None:
        monitor.close()
    engine.destroy()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 3], choices=[0, 1, 2, 3])
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="wall: elapsed time; cpu: this process's CPU time (all threads), for shared machines")
    args = parser.parse_args()
    import deepspeed

    if not torch.cuda.is_available():
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip a slow CPU-only JIT build
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    out = tempfile.mkdtemp(prefix="trainmon_ds_bench_")
    keys = [(stage, case) for stage in args.stages for case in DS_CASES]
    rounds: dict[tuple[int, str], list[float]] = {key: [] for key in keys}
    try:
        for _ in range(args.rounds):  # alternate: drift and a noisy neighbour hit every case alike
            for stage, case in keys:
                rounds[(stage, case)].append(statistics.median(_train(stage, case, args.steps, out, args.clock)))
    finally:
        torch.distributed.destroy_process_group()
    best = {key: min(values) for key, values in rounds.items()}
    print(f"DeepSpeed on cpu, 1 rank, fp32, model {SHAPE}, batch {BATCH}, threads {torch.get_num_threads()}, "
          f"clock {args.clock}, {args.rounds} rounds x {args.steps} steps (best round's median)")
    print(f"{'stage':<7} {'case':<9} {'step ms':>9} {'time ratio':>11}")
    for stage, case in keys:
        ratio = best[(stage, case)] / best[(stage, "none")]
        print(f"ZeRO-{stage:<2} {case:<9} {best[(stage, case)] * 1e3:>9.1f} {ratio:>10.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
