"""2-rank gloo script for tests/distributed/test_comm.py: runs collectives under a CommCollector.

Run as ``RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python comm_ranks.py OUT_DIR``;
writes ``OUT_DIR/rank{r}.json`` with the finalised rows and scalars of every step. The inputs come
from :func:`inputs` so the test can rebuild them in numpy. Then :func:`monitor_run` trains a small
model under a ``TrainerMonitor`` into ``OUT_DIR/run``: its middle layer all-reduces inside its
forward (and its gradient inside the backward pass), and rank 1 puts a NaN into that all-reduce at
step 3.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn

from trainmon import TrainerMonitor
from trainmon.base.records import METRICS, finalize
from trainmon.collect.buffer import StepBuffer
from trainmon.collect.comm import CommCollector
from trainmon.collect.context import StepContext
from trainmon.collect.stats_base import StatsSpec
from trainmon.config import COMM_OPS, CommunicationConfig

N = 16


def inputs(rank: int, seed: int, n: int = N) -> np.ndarray:
    """The float32 data rank ``rank`` contributes to the collective number ``seed``."""
    return (np.random.default_rng(100 * seed + rank).standard_normal(n) * (seed + 1)).astype(np.float32)


def t(rank: int, seed: int, n: int = N) -> torch.Tensor:
    return torch.from_numpy(inputs(rank, seed, n))


def end_step(ctx: StepContext, collector: CommCollector) -> dict:
    collector.before_transfer()
    host = ctx.buffer.transfer()
    rows = []
    for key, partial in zip(host.keys, host.partials):
        values, nonfinite = finalize(partial, METRICS)
        rows.append({"name": key.name, "family": key.family, "micro_step": key.micro_step, "order": key.order,
                     "values": values, "nonfinite": bool(nonfinite)})
    ctx.buffer = StepBuffer()
    return {"rows": rows, "scalars": host.scalars}


def reduce_here(tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor)


def skipped_reduce(tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor)


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    originals = {(m.__name__, n): getattr(m, n) for m in (dist, c10d) for n in COMM_OPS if hasattr(m, n)}
    only_one = dist.new_group([1])  # every rank must call new_group
    ctx = StepContext(specs={"comm": StatsSpec.from_metrics(METRICS, 1e-8)}, metrics={"comm": list(METRICS)})
    collector = CommCollector(ctx, CommunicationConfig(enabled=True))
    out: dict = {"steps": {}, "checks": {}}
    out["checks"]["wrapped"] = dist.all_reduce is not originals[("torch.distributed", "all_reduce")]

    # step 0: synchronous collectives
    ctx.collecting, ctx.step = True, 0
    for tensor in (t(rank, 1), t(rank, 2, 2 * N)):  # two calls: one row each (call0, call1)
        dist.all_reduce(tensor)
    dist.reduce_scatter_tensor(torch.empty(N // 2), t(rank, 3))
    dist.reduce_scatter(torch.empty(N // 2), list(t(rank, 4).chunk(2)))
    gathered = [torch.empty(N), torch.empty(N)]
    dist.all_gather(gathered, t(rank, 5))
    dist.all_gather_into_tensor(torch.empty(2 * N), t(rank, 6))
    dist.broadcast(t(rank, 7) if rank == 0 else torch.full((N,), float("nan")), src=0)
    if rank == 0:
        dist.send(t(0, 8), dst=1)
    else:
        dist.recv(torch.empty(N), src=0)
    if rank == 1:
        dist.all_reduce(t(1, 9), group=only_one)
    out["steps"]["0"] = end_step(ctx, collector)

    # step 1: an async call is measured after wait(); a collective after before_transfer is not measured
    ctx.step = 1
    tensor = t(rank, 10)
    work = dist.all_reduce(tensor, async_op=True)
    out["checks"]["work_is_work"] = isinstance(work, dist.Work)
    out["checks"]["rows_before_wait"] = [list(k) for k in collector._rows]
    work.wait()
    peer = 1 - rank
    received = torch.empty(N)
    ops = [dist.P2POp(dist.isend, t(rank, 15), peer), dist.P2POp(dist.irecv, received, peer)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    collector.before_transfer()
    keys_before = len(ctx.buffer.keys)
    dist.all_reduce(torch.ones(4))  # the monitor's own end-of-step collective
    out["checks"]["internal_measured"] = len(ctx.buffer.keys) - keys_before
    ctx.buffer.keys = ctx.buffer.keys[:keys_before]
    out["steps"]["1"] = end_step(ctx, collector)

    # step 2: not collected
    ctx.collecting, ctx.step = False, 2
    dist.all_reduce(t(rank, 11))
    out["steps"]["2"] = end_step(ctx, collector)

    # step 3: a NaN on rank 1 before an all_reduce
    ctx.collecting, ctx.step = True, 3
    tensor = t(rank, 12)
    if rank == 1:
        tensor[3] = float("nan")
    dist.all_reduce(tensor)
    out["steps"]["3"] = end_step(ctx, collector)

    collector.close()
    collector.close()
    out["checks"]["restored"] = all(getattr(sys.modules[m], n) is f for (m, n), f in originals.items())

    # call sites, with a filter on the function name
    sites = CommCollector(ctx, CommunicationConfig(enabled=True, ops=["all_reduce"], call_sites=True,
                                                   call_site_filter=r" in reduce_"))
    ctx.step = 4
    reduce_here(t(rank, 13))
    reduce_here(t(rank, 16, 3 * N))  # same call site, 3x the elements: one row, mean weighted by size
    skipped_reduce(t(rank, 14))
    out["steps"]["4"] = end_step(ctx, collector=sites)
    sites.close()

    # a foreign wrapper installed after ours is not clobbered by close()
    third = CommCollector(ctx, CommunicationConfig(enabled=True))
    ours = dist.all_reduce

    def foreign(*args, **kwargs):
        foreign.calls += 1
        return ours(*args, **kwargs)

    foreign.calls = 0
    dist.all_reduce = foreign
    third.close()
    out["checks"]["foreign_kept"] = dist.all_reduce is foreign
    out["checks"]["c10d_restored"] = c10d.all_reduce is originals[("torch.distributed.distributed_c10d", "all_reduce")]
    ctx.step = 5
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    out["checks"]["foreign_result"] = tensor.tolist()
    out["checks"]["foreign_calls"] = foreign.calls
    out["steps"]["5"] = end_step(ctx, collector=third)
    dist.all_reduce = originals[("torch.distributed", "all_reduce")]  # the foreign code's own clean-up

    monitor_run(out_dir, rank, out, originals[("torch.distributed", "all_reduce")])
    out["checks"]["monitor_restored"] = all(getattr(sys.modules[m], n) is f for (m, n), f in originals.items())

    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(out, f)


class ReducingLayer(nn.Module):
    """Linear + tanh whose output is all-reduced inside its forward (as tensor parallelism does) and
    whose gradient is all-reduced inside the backward pass; ``poison`` puts a NaN into the forward one."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        shared = h.detach().clone()
        if self.poison:
            shared[0, 0] = float("nan")
        dist.all_reduce(shared)
        if h.requires_grad:
            h.register_hook(_reduce_gradient)
        return h + shared / dist.get_world_size()


def _reduce_gradient(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    dist.all_reduce(grad)  # runs inside autograd's backward pass
    return grad / dist.get_world_size()


def monitor_run(out_dir: str, rank: int, out: dict, original_all_reduce) -> None:
    """4 steps of a 3-layer model under TrainerMonitor with communication monitoring; gradients
    all-reduced by hand after backward(); rank 1's forward all-reduce gets a NaN at step 3."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), ReducingLayer(8), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TrainerMonitor({"output_dir": out_dir, "run_name": "run", "sinks": ["csv"],
                              "activations": {"enabled": True, "metrics": ["norm", "nans"]},
                              "communication": {"enabled": True, "metrics": list(METRICS)},
                              "anomaly": {"actions": ["jsonl", "callback"]}})
    events: list = []
    monitor.on_anomaly(events.append)
    monitor.attach(model, optimizer)
    out["checks"]["monitor_wrapped"] = dist.all_reduce is not original_all_reduce
    generator = torch.Generator().manual_seed(rank)
    phases: dict = {}
    try:
        for step in range(4):
            model[1].poison = (rank, step) == (1, 3)
            x = torch.randn(4, 8, generator=generator)
            loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            loss.backward()
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)
            optimizer.step()
            optimizer.zero_grad()
            record = monitor.step(loss=loss)
            if step == 0:
                phases = {row.key.name: [row.key.phase, row.key.order] for row in record.rows
                          if row.key.family == "comm"}
    finally:
        monitor.close()
    out["monitor"] = {"phases": phases, "events": [e.to_dict() for e in events]}
    out["run_dir"] = os.path.join(out_dir, "run")


if __name__ == "__main__":
    main(sys.argv[1])
