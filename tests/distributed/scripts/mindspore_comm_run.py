"""One msrun worker: MindSpore collectives measured by trainmon, with float64 references of what was sent.

Usage (by tests/distributed/test_mindspore_actions.py):
    msrun --worker_num=2 --local_worker_num=2 --master_port=P --log_dir=D --join=True this.py OUT_DIR

Each step every rank sends known tensors (a function of rank and step) through
``mindspore.mint.distributed`` (``all_reduce``, also async, ``broadcast``, ``all_gather``), through
``mindspore.ops.all_reduce`` and ``ops.broadcast``, and through the ``AllReduce`` and ``AllGather``
primitives (created after ``attach``), trains through a
``DistributedGradReducer`` (its ``construct`` is compiled with ``@jit``: not measured), and writes what it
sent and received as float64 numpy statistics to ``OUT_DIR/refs_rank{R}.json``.
After ``close()`` it records whether every original function and primitive class is back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mindspore as ms
import mindspore.mint.distributed as dist
import mindspore.nn.wrap.grad_reducer as grad_reducer
import numpy as np
from mindspore import Tensor, nn, ops
from mindspore.communication import get_group_size, get_rank, init

from trainmon import TrainerMonitor

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")
init()
rank, world = get_rank(), get_group_size()
out = Path(sys.argv[1])
ms.set_seed(0)
ORIGINALS = {"mint.all_reduce": dist.all_reduce, "mint.broadcast": dist.broadcast, "mint.all_gather": dist.all_gather,
             "ops.all_reduce": ops.all_reduce, "ops.broadcast": ops.broadcast,
             "ops.AllReduce": ops.AllReduce, "ops.AllGather": ops.AllGather,
             "grad_reducer.AllReduce": grad_reducer.AllReduce}


def sent(step: int, which: int, shape: tuple[int, ...], r: int = -1) -> np.ndarray:
    """The tensor rank ``r`` (default: this rank) sends in call ``which`` of ``step``."""
    r = rank if r < 0 else r
    rng = np.random.default_rng(1000 * step + 10 * which + r)
    values = rng.standard_normal(shape).astype(np.float32)
    if which == 0 and step == 1 and r == 1:
        values[0, 0] = np.nan  # a NaN one rank sends
    return values


def stats(a: np.ndarray) -> dict[str, float]:
    a = np.asarray(a, dtype=np.float64).ravel()
    return {"norm": float(np.sqrt(np.sum(a * a))), "min": float(np.min(a)), "max": float(np.max(a)),
            "mean": float(np.mean(a)), "nans": float(np.isnan(a).sum())}


net = nn.SequentialCell(nn.Dense(4, 3))
opt = nn.SGD(net.trainable_params(), learning_rate=0.0)
monitor = TrainerMonitor({"output_dir": str(out), "run_name": "comm", "sinks": ["csv"],
                          "weight_grads": {"enabled": False}, "optimizer_states": {"enabled": False},
                          "communication": {"enabled": True, "metrics": ["norm", "min", "max", "mean", "nans"]},
                          "anomaly": {"detectors": [], "actions": []}})
monitor.attach(net, opt)
reducer = nn.DistributedGradReducer(opt.parameters, mean=True, degree=world)  # built while attached
all_reduce_prim, all_gather_prim = ops.AllReduce(), ops.AllGather()
grad_fn = ms.value_and_grad(lambda x: net(x).sum(), None, opt.parameters)
refs: dict[str, dict] = {}
for step in range(3):
    rows: dict[str, dict[str, float]] = {}
    everyone = [sent(step, 0, (2, 3), r) for r in range(world)]
    t = Tensor(everyone[rank])
    dist.all_reduce(t)                                    # in place
    rows["all_reduce.g0-1.call0.pre.0"] = stats(everyone[rank])
    rows["all_reduce.g0-1.call0.post.0"] = stats(np.sum(np.stack(everyone).astype(np.float64), axis=0))
    b = Tensor(sent(step, 1, (5,)) if rank == 0 else np.zeros(5, np.float32))
    dist.broadcast(b, src=0)
    if rank == 0:
        rows["broadcast.g0-1.call0.pre.0"] = stats(sent(step, 1, (5,)))
    rows["broadcast.g0-1.call0.post.0"] = stats(sent(step, 1, (5,), 0))
    parts = [ops.zeros((4,), ms.float32) for _ in range(world)]
    dist.all_gather(parts, Tensor(sent(step, 2, (4,))))
    rows["all_gather.g0-1.call0.pre.0"] = stats(sent(step, 2, (4,)))
    for r in range(world):
        rows[f"all_gather.g0-1.call0.post.{r}"] = stats(sent(step, 2, (4,), r))
    handle = dist.all_reduce(a := Tensor(sent(step, 3, (3,))), async_op=True)
    handle.wait()
    rows["all_reduce.g0-1.call1.pre.0"] = stats(sent(step, 3, (3,)))
    rows["all_reduce.g0-1.call1.post.0"] = stats(sum(sent(step, 3, (3,), r).astype(np.float64) for r in range(world)))
    all_reduce_prim(Tensor(sent(step, 4, (2, 2))))
    rows["all_reduce.g0-1.call2.pre.0"] = stats(sent(step, 4, (2, 2)))
    rows["all_reduce.g0-1.call2.post.0"] = stats(sum(sent(step, 4, (2, 2), r).astype(np.float64) for r in range(world)))
    all_gather_prim(Tensor(sent(step, 5, (2, 2))))
    rows["all_gather_into_tensor.g0-1.call0.pre.0"] = stats(sent(step, 5, (2, 2)))
    rows["all_gather_into_tensor.g0-1.call0.post.0"] = stats(np.concatenate([sent(step, 5, (2, 2), r)
                                                                             for r in range(world)]))
    ops.all_reduce(c := Tensor(sent(step, 7, (3, 2))))     # in place (MindSpore's in-place mode)
    rows["all_reduce.g0-1.call3.pre.0"] = stats(sent(step, 7, (3, 2)))
    rows["all_reduce.g0-1.call3.post.0"] = stats(sum(sent(step, 7, (3, 2), r).astype(np.float64) for r in range(world)))
    ops.broadcast(d := Tensor(sent(step, 8, (4,)) if rank == 1 else np.zeros(4, np.float32)), 1)
    if rank == 1:
        rows["broadcast.g0-1.call1.pre.0"] = stats(sent(step, 8, (4,)))
    rows["broadcast.g0-1.call1.post.0"] = stats(sent(step, 8, (4,), 1))
    x = Tensor(sent(step, 6, (2, 4)))
    loss, grads = grad_fn(x)
    opt(reducer(grads))                                   # compiled (@jit): no Python-level call to measure
    monitor.step(loss=loss)
    refs[str(step)] = rows
monitor.close()
restored = {name: eval(name.replace("mint.", "dist.")) is original for name, original in ORIGINALS.items()}
(out / f"refs_rank{rank}.json").write_text(json.dumps({"steps": refs, "restored": restored, "world": world}))
print(f"RANK {rank}/{world} done", flush=True)
