"""Cost of the dump's non-finite localisation step on a small GPT (examples/tiny_gpt.py).

    python benchmarks/localise_cost.py [--steps 8] [--rounds 3] [--layers 4] [--device cpu|cuda]

When an anomaly's first origin names no module (the loss, with activations off) the dump checks every
module of the model on the next step(s): ``[min, max]`` of every module's inputs, outputs, own
parameters (first call) and of the gradients w.r.t. its outputs and inputs, and one host transfer at
the end of the step. This measures one training step (forward, backward, AdamW) with those checks
against the same step without them (alternating rounds; per case the median step of its best round),
and prints the number of modules, hooks and reductions of a checked step. Only the checked step pays:
other steps run with none of these hooks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))
from tiny_gpt import TinyGPT, gpt_loss, make_batch  # noqa: E402

from trainmon.actions.frameworks import TorchFramework  # noqa: E402
from trainmon.actions.localise import NonfiniteLocaliser  # noqa: E402
from trainmon.actions.modules import ModuleTable  # noqa: E402


def _round(localise: bool, steps: int, layers: int, device: str) -> tuple[list[float], dict[str, int]]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=1024, d=256, layers=layers, heads=4, seq=128).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = [t.to(device) for t in make_batch(0, 8, 128, 1024)]
    localiser = NonfiniteLocaliser(ModuleTable(model, TorchFramework()), max_steps=10 ** 9)
    times, counts = [], {}
    for step in range(steps + 1):  # step 0 warms up
        if localise:
            localiser.request(0, "loss")
            localiser.begin_step(step)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = gpt_loss(model, *batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if localise:
            counts = {"modules": len(localiser.table.entries), "reductions": len(localiser._extremes),
                      "hooks": localiser._registry.count()}
            localiser.end_step()  # includes the step's one host transfer
        if device == "cuda":
            torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - start)
    localiser.close()
    return times, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    best: dict[bool, float] = {}
    counts: dict[str, int] = {}
    for _ in range(args.rounds):
        for localise in (False, True):
            times, found = _round(localise, args.steps, args.layers, args.device)
            best[localise] = min(best.get(localise, float("inf")), statistics.median(times))
            counts = found or counts
    print(f"TinyGPT d=256, {args.layers} layers, batch 8 x 128 tokens, {torch.get_num_threads()} thread(s), "
          f"{args.device}: {counts}")
    print(f"step without checks {best[False] * 1e3:.1f} ms, with checks {best[True] * 1e3:.1f} ms "
          f"({best[True] / best[False]:.2f}x)")


if __name__ == "__main__":
    main()
