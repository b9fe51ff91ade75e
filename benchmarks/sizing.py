"""What a run writes, projected for model shapes x configs (docs/sizing.md).

Usage: ``python benchmarks/sizing.py [--steps 10000] [--ranks 64 4096]``

Each model is built on torch's meta device (no memory: a 70B shape attaches in a second) and attached with the
real ``TrainerMonitor``: the real target selection and collectors, and the same projection
(:mod:`trainmon.runtime.sizing`) that logs its line at attach; the run directory goes to a temporary folder.
Models: Llama-shaped models of ``transformers`` (7B: 32 layers, hidden 4096, 291 parameter tensors; 70B: 80
layers, hidden 8192, 723 tensors) and the README demo's TinyGPT (``examples/tiny_gpt.py``).

Prints a markdown table: rows and bytes per collected step per rank, and bytes for ``--steps`` steps on each
``--ranks``, twice: with every rank writing every family (``write_replicated_once: false``, or a set-up without a
data-parallel group trainmon knows of), and as trainmon writes it by default under pure data parallelism (torch
DDP or Megatron-Core over all ranks: one data-parallel group), where the families identical on every replica
(``grad_reduced``, ``param``, the optimizer states) are written by one rank of the group. One process cannot
make 64 ranks, so the second figure is the projection :class:`~trainmon.runtime.sizing.Sizing` makes at attach
for such a run (its ``bytes_per_run``), fed the families measured here.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from trainmon import TrainerMonitor
from trainmon.integrations.base import REPLICATED_FAMILIES
from trainmon.runtime.sizing import FamilySize, Sizing, human_bytes

LARGE_RUN: dict[str, Any] = {
    "sinks": ["parquet"],
    "step_interval": 10,
    "weight_grads": {"metrics": ["norm", "max", "nans"]},
    "optimizer_states": {"metrics": ["norm", "max", "nans"]},
}
"""The large-run config of docs/sizing.md (keep the two in step)."""
BLOCK_OUTPUTS = {"enabled": True, "inputs": False, "backward": False, "metrics": ["norm", "max", "nans"]}

PER_TENSOR = {"tensorboard": {"per_tensor": True}}
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "default, TensorBoard per tensor": PER_TENSOR,
    "default + activations": {"activations": {"enabled": True}},
    "default, sinks [parquet]": {"sinks": ["parquet"]},
    "large-run": LARGE_RUN,
    "large-run + block outputs": {**LARGE_RUN, "activations": BLOCK_OUTPUTS,
                                  "targets": {"modules": [r"re:^(model\.layers|blocks)\.\d+$"]}},
    "large-run, step_interval 100": {**LARGE_RUN, "step_interval": 100},
}


def llama(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=intermediate,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=32000)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def demo_gpt() -> torch.nn.Module:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from tiny_gpt import TinyGPT

    with torch.device("meta"):
        return TinyGPT(vocab=128, d=64, layers=4, heads=4, seq=32)


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "7B shape": lambda: llama(32, 4096, 11008, 32, 32),
    "70B shape": lambda: llama(80, 8192, 28672, 64, 8),
    "demo GPT": demo_gpt,
}


def sizing_of(model: torch.nn.Module, config: dict[str, Any], out: Path) -> Sizing:
    """The projection a real attach (AdamW on the meta parameters) writes into ``run.json``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run_name = f"run{len(list(out.iterdir()))}"
    with TrainerMonitor({"output_dir": str(out), "run_name": run_name, **config}) as monitor:
        monitor.attach(model, optimizer)
    info = json.loads((out / run_name / "run.json").read_text())
    sizing, resolved = info["sizing"], info["config"]
    families = tuple(FamilySize(family, rows, family in sizing["estimated"], sizing["bytes_per_row"][family])
                     for family, rows in sizing["rows_per_collected_step"].items())
    return Sizing(families, tuple(resolved["sinks"]), resolved["step_interval"], resolved["collect_times"],
                  overview_bytes=sizing["tensorboard_overview_bytes_per_collected_step"])


def stored_once(sizing: Sizing, steps: int, ranks: int) -> float:
    """Bytes of a run on ``ranks`` ranks whose data-parallel replicated families are written by one rank (pure data
    parallelism, ``write_replicated_once: true``): the projection made at attach for such a run."""
    return replace(sizing, world_size=ranks, replicated=REPLICATED_FAMILIES, replica_writers=1).bytes_per_run(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 4096])
    args = parser.parse_args()
    logging.getLogger("trainmon").setLevel(logging.WARNING)
    header = ["model", "config", "rows / collected step", "per collected step, rank", f"{args.steps:,} steps, rank"]
    for ranks in args.ranks:
        header += [f"x{ranks:,} ranks, every rank writes", f"x{ranks:,} ranks, DDP (once per group)*"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for model_name, build in MODELS.items():
            model = build()
            n_params = len(list(model.parameters()))
            for config_name, config in CONFIGS.items():
                sizing = sizing_of(model, config, Path(tmp))
                per_rank = sizing.bytes_per_steps(args.steps)
                rows = f"{'~' if sizing.estimated else ''}{sizing.rows_per_step:,}"
                cells = [f"{model_name} ({n_params} tensors)", config_name, rows,
                         human_bytes(sizing.bytes_per_step), human_bytes(per_rank)]
                for ranks in args.ranks:
                    cells += [human_bytes(per_rank * ranks), human_bytes(stored_once(sizing, args.steps, ranks))]
                print("| " + " | ".join(cells) + " |", flush=True)
        print("\nPer family, 7B shape, default config + activations, TensorBoard per tensor (bytes per row; "
              "TensorBoard: its 7 points):")
        print("\n| family | rows / collected step | CSV | TensorBoard | Parquet |\n|---|---|---|---|---|")
        detail = sizing_of(MODELS["7B shape"](), {**CONFIGS["default + activations"], **PER_TENSOR}, Path(tmp))
        for family in detail.families:
            sizes = family.bytes_per_row
            print(f"| {family.family} | {'~' if family.estimated else ''}{family.rows:,} | {sizes['csv']:.0f} | "
                  f"{sizes['tensorboard']:.0f} | {sizes['parquet']:.0f} |")
        print(f"\nTensorBoard's overview, 7B shape, default config + activations: {detail.overview_bytes:,.0f} bytes "
              "per collected step (whatever the model)")


if __name__ == "__main__":
    main()
