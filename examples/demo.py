"""trainmon demo: a small GPT trains on CPU with the monitor; a bug is injected and found.

    python examples/demo.py [--steps 40] [--bad-step 30] [--output-dir ./trainmon_output]

At ``--bad-step`` a simulated bug (a division by zero in block 2's MLP) produces NaN.
The monitor's first-origin answer names the step, micro-step, phase and module where the
NaN first appeared, instead of the hundreds of downstream NaNs.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_gpt import TinyGPT, gpt_loss, make_batch

from trainmon import TrainerMonitor
from trainmon.tools.store import open_run

COUNTS = ("nans", "infs")  # metrics that count elements: printed as integers

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--bad-step", type=int, default=30, help="step at which the bug fires (-1: never)")
    parser.add_argument("--output-dir", default="./trainmon_output")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.manual_seed(0)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    vocab, seq = 128, 32
    model = TinyGPT(vocab=vocab, d=64, layers=4, heads=4, seq=seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    state = {"step": 0}

    def bug(module, inputs, output):  # the simulated bug: 0/0 in one module on one step
        if state["step"] == args.bad_step:
            return output / torch.zeros_like(output)
        return output

    bug_handle = model.blocks[2].mlp.fc2.register_forward_hook(bug)

    config = {
        "output_dir": args.output_dir,
        "activations": {"enabled": True, "metrics": ["norm", "min", "max", "mean", "nans", "infs"]},
        "weight_grads": {"enabled": True},
        "optimizer_states": {"enabled": True},
        "anomaly": {"detectors": [{"type": "nonfinite"}, {"type": "loss_spike"}],
                    "actions": ["log", "jsonl", "callback"]},
    }
    events = []
    print(f"training a 4-layer d=64 GPT on CPU for {args.steps} steps with the monitor (every family, 6 metrics; "
          f"a 0/0 bug fires at step {args.bad_step}); output under {args.output_dir}", flush=True)
    start = time.perf_counter()
    with TrainerMonitor(config) as monitor:
        monitor.on_anomaly(events.append)
        monitor.attach(model, optimizer)
        for step in range(args.steps):
            state["step"] = step
            tokens, targets = make_batch(step, 16, seq, vocab)
            loss = gpt_loss(model, tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(loss=loss)
            if step % 10 == 0 or step == args.steps - 1:
                print(f"step {step:3d}  loss {loss.item():.4f}")
        run_dir = monitor.run_dir
    bug_handle.remove()
    elapsed = time.perf_counter() - start
    print(f"\ntrained {args.steps} steps in {elapsed:.1f} s; monitor output in {run_dir}")
    store = run_dir / "store"
    tables = sorted(path.name for path in store.iterdir() if path.is_dir()) if store.is_dir() else []
    print(f"  store/ (Parquet, one table per family): {', '.join(tables)}")
    for path in sorted((run_dir / "rank0").iterdir()):
        print(f"  {path.relative_to(run_dir)}")
    _summary(run_dir, events)
    print(f"\ncross-rank analysis: trainmon analyse {run_dir}")
    print(f"SQL over the store:   trainmon query {run_dir} \"SELECT step, value FROM scalars WHERE name = 'loss'\"")
    print(f"monitor output (monitor.run_dir): {run_dir}")
    print(f"look at it in TensorBoard:        tensorboard --logdir {run_dir}")
    return 0


def _summary(run_dir: Path, events: list) -> None:
    connection = open_run(run_dir)  # the run store as DuckDB views, one per family
    try:
        largest = connection.sql("SELECT name, norm FROM grad_reduced WHERE step = 0 "
                                 "ORDER BY norm DESC LIMIT 3").fetchall()
    finally:
        connection.close()
    print("\nlargest gradient norms at step 0:")
    for name, norm in largest:
        print(f"  {name:<28} {norm:.4g}")
    if not events:
        print("\nno anomaly found")
        return
    steps = sorted({e.step for e in events})
    print(f"\n{len(events)} anomaly events over steps {steps[0]}..{steps[-1]}; the first in execution order:")
    e = events[0]
    value = int(e.value) if e.metric in COUNTS and math.isfinite(e.value) else e.value
    print(f"  step {e.step}, micro-step {e.micro_step}, rank {e.rank}, {e.phase} of {e.name} "
          f"({e.metric} = {value}) [{e.detector}]")


if __name__ == "__main__":
    sys.exit(main())
