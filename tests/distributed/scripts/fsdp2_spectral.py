"""Spectral features of an FSDP2 model (``fully_shard``) on 2 gloo CPU ranks, with the script's float64 references.

``python fsdp2_spectral.py OUT`` on 2 ranks (the launcher's ``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``): a small GPT
whose blocks are sharded with ``Shard(0)``, except each block's ``mlp.fc2`` with ``Shard(1)`` (its columns split);
trained 3 steps with ``features.weights`` (and ``features.attention``: its hooks run while FSDP has the blocks
unsharded). Writes ``OUT/rank{R}/...`` (trainmon) and ``OUT/refs_rank{R}.json``: per step, numpy's largest singular
value and stable rank of every 2-D parameter's ``full_tensor()`` after the optimizer step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from tiny_gpt import TinyGPT, gpt_loss, make_batch

from trainmon import TrainerMonitor


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=4, seq=16)
    for block in model.blocks:
        fully_shard(block, mesh=mesh,
                    shard_placement_fn=lambda p, fc2=block.mlp.fc2.weight: Shard(1) if p is fc2 else None)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = TrainerMonitor({"output_dir": str(out.parent), "run_name": out.name, "sinks": ["csv"],
                              "weight_grads": {"enabled": False}, "optimizer_states": {"enabled": False},
                              "features": {"weights": {"enabled": True, "iterations": 100},
                                           "attention": {"enabled": True}}})
    monitor.attach(model, optimizer)
    refs = {}
    for step in range(3):
        tokens, targets = make_batch(10 * step + rank, 2, 16, 64)
        gpt_loss(model, tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step()
        weights = {}
        for name, param in model.named_parameters():
            if param.dim() == 2:
                matrix = param.full_tensor().detach().double().numpy()
                sigma = float(np.linalg.svd(matrix, compute_uv=False)[0])
                weights[name] = {"spectral_norm": sigma, "stable_rank": float((matrix ** 2).sum() / sigma ** 2),
                                 "split_dim": int(param.placements[0].dim)}
        refs[str(step)] = weights
    monitor.close()
    (out / f"refs_rank{rank}.json").write_text(json.dumps(refs))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
