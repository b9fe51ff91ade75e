"""DDP with torch's ``ZeroRedundancyOptimizer`` (Adam states sharded over the ranks by parameter), monitored by
trainmon, on 2 gloo ranks: ``python zero_redundancy_run.py OUT``.

Each rank writes ``OUT/refs_rank{R}.json``, the test's own float64 references: per step the norm of every
gradient the optimizer used (read in an optimizer step pre-hook of the test's own), the global grad norm, and the
``exp_avg``/``exp_avg_sq`` norms of the parameters whose state this rank holds (read from the local optimizer);
and whether the parameters after training are bit-identical to an unmonitored run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from trainmon import TrainerMonitor

STEPS = 3


def train(out: Path, monitored: bool) -> tuple[list[torch.Tensor], list[dict]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
    names = {p: name for name, p in model.named_parameters()}
    refs: list[dict] = []

    def before_step(opt, args, kwargs):
        grads = {names[p]: p.grad.double() for p in model.parameters()}
        refs.append({"grads": {n: float(g.norm()) for n, g in grads.items()},
                     "grad_norm": float(torch.stack([g.norm() for g in grads.values()]).norm())})

    handle = optimizer.register_step_pre_hook(before_step)
    monitor = None
    if monitored:
        monitor = TrainerMonitor({"output_dir": str(out), "run_name": "run", "sinks": ["csv"],
                                  "optimizer_states": {"states": ["exp_avg", "exp_avg_sq", "update", "ratio"]}})
        monitor.attach(ddp, optimizer)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10 * dist.get_rank() + step)
        loss = torch.nn.functional.mse_loss(ddp(torch.randn(8, 16, generator=g)), torch.randn(8, 1, generator=g))
        loss.backward()
        optimizer.step()
        refs[-1]["states"] = {names[p]: {key: float(state[key].double().norm()) for key in ("exp_avg", "exp_avg_sq")}
                              for p, state in optimizer.optim.state.items()}
        optimizer.zero_grad()
        if monitor is not None:
            monitor.step(loss=loss)
    if monitor is not None:
        monitor.close()
    handle.remove()
    return [p.detach().clone() for p in model.parameters()], refs


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    try:
        expected, _ = train(out, monitored=False)
        got, refs = train(out, monitored=True)
        identical = all(torch.equal(a, b) for a, b in zip(got, expected))
        (out / f"refs_rank{dist.get_rank()}.json").write_text(json.dumps(
            {"steps": refs, "identical": identical, "nan": bool(np.isnan([r["grad_norm"] for r in refs]).any())}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
