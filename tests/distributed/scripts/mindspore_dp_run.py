"""One msrun worker: data-parallel MindSpore training with trainmon; rank 1 gets a NaN at step 1.

Usage (by tests/distributed/test_mindspore_msrun.py):
    msrun --worker_num=2 --local_worker_num=2 --master_port=P --log_dir=D --join=True this.py OUT_DIR
"""

from __future__ import annotations

import sys

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops
from mindspore.communication import get_group_size, get_rank, init

from trainmon import TrainerMonitor

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")
init()
rank, world = get_rank(), get_group_size()
ms.set_seed(0)
net = nn.SequentialCell(nn.Dense(6, 8), nn.ReLU(), nn.Dense(8, 2))
opt = nn.Adam(net.trainable_params(), learning_rate=1e-2)
reducer = nn.DistributedGradReducer(opt.parameters, mean=True, degree=world)
monitor = TrainerMonitor({"output_dir": sys.argv[1], "run_name": "dp", "sinks": ["csv"],
                          "activations": {"enabled": True, "backward": False},
                          "optimizer_states": {"states": ["exp_avg"]},
                          "anomaly": {"detectors": [{"type": "nonfinite"}], "actions": ["jsonl"]}})
monitor.attach(net, opt)
grad_fn = ms.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, opt.parameters)
rng = np.random.default_rng(rank)
for step in range(3):
    x = Tensor(rng.standard_normal((4, 6)).astype(np.float32))
    if rank == 1 and step == 1:
        x = x * Tensor(float("nan"), ms.float32)  # bad data on one rank
    y = ops.ones((4, 2), ms.float32)
    loss, grads = grad_fn(x, y)
    opt(reducer(grads))
    monitor.step(loss=loss)
monitor.close()
print(f"RANK {rank}/{world} done", flush=True)
