"""Model features under DeepSpeed (one gloo rank, CPU): ZeRO-2 and ZeRO-3.

``python ds_features.py OUT`` (the launcher's ``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``). ZeRO-2: attn rows and
weight_features of the whole matrices the module holds; writes ``OUT/z2/refs.json`` (numpy's largest singular value of
each 2-D parameter after the last step). ZeRO-3: features.weights is refused at attach (the error goes to
``OUT/z3_error.txt``), features.attention runs on the parameters ZeRO-3 gathers for the forward.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from tiny_gpt import TinyGPT, gpt_loss, make_batch

from trainmon import TrainerMonitor
from trainmon.errors import UnsupportedSetupError


def engine_of(stage: int) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=4, seq=16)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "weight_decay": 0.0}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train(engine: deepspeed.DeepSpeedEngine, monitor: TrainerMonitor) -> None:
    monitor.attach(engine)
    for step in range(2):
        tokens, targets = make_batch(step, 2, 16, 64)
        loss = gpt_loss(engine, tokens, targets)
        engine.backward(loss)
        engine.step()
        monitor.step(loss=loss)
    monitor.close()


def main() -> None:
    out = Path(sys.argv[1])
    deepspeed.init_distributed(dist_backend="gloo")
    engine = engine_of(2)
    train(engine, TrainerMonitor({"output_dir": str(out), "run_name": "z2", "sinks": ["csv"],
                                  "features": {"attention": {"enabled": True},
                                               "weights": {"enabled": True, "iterations": 200}}}))
    refs = {name: float(np.linalg.svd(p.detach().double().numpy(), compute_uv=False)[0])
            for name, p in engine.module.named_parameters() if p.dim() == 2}
    (out / "z2" / "refs.json").write_text(json.dumps(refs))
    engine = engine_of(3)
    try:
        TrainerMonitor({"output_dir": str(out), "run_name": "z3w", "features": {"weights": {"enabled": True}}}
                       ).attach(engine)
    except UnsupportedSetupError as exc:
        (out / "z3_error.txt").write_text(str(exc))
    train(engine, TrainerMonitor({"output_dir": str(out), "run_name": "z3", "sinks": ["csv"],
                                  "features": {"attention": {"enabled": True}}}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
