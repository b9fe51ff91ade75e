"""Train a small MindSpore network (PyNative, CPU) with trainmon.

    python examples/mindspore_train.py --steps 5 --output-dir ./trainmon_output
    trainmon analyse ./trainmon_output/mindspore_example
"""

from __future__ import annotations

import argparse

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

from trainmon import TrainerMonitor


class Mlp(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Dense(8, 32), nn.ReLU(), nn.Dense(32, 1)

    def construct(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--output-dir", default="./trainmon_output")
    args = parser.parse_args()
    ms.set_context(mode=ms.PYNATIVE_MODE)  # cell hooks run in PyNative mode only
    ms.set_device("CPU")
    net = Mlp()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=1e-2)
    config = {"output_dir": args.output_dir, "run_name": "mindspore_example", "activations": {"enabled": True}}
    grad_fn = ms.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, optimizer.parameters)
    rng = np.random.default_rng(0)
    with TrainerMonitor(config) as monitor:
        monitor.attach(net, optimizer)
        for step in range(args.steps):
            x = rng.standard_normal((16, 8)).astype(np.float32)
            loss, grads = grad_fn(Tensor(x), Tensor(x.sum(axis=1, keepdims=True)))
            optimizer(grads)
            monitor.step(loss=loss)
            print(f"step {step}: loss {float(loss.asnumpy()):.4f}")
        print(f"outputs in {monitor.run_dir}")


if __name__ == "__main__":
    main()
