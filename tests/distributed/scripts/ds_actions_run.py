"""DeepSpeed (one process, gloo, CPU) under TrainerMonitor with the default families and the dump action.

``python ds_actions_run.py OUT STAGE``

A NaN is put into the output of ``layers.1.fc2`` from step 2 on. With activations off the first origin
of step 2 is the loss; the dump localises the module on step 3 and dumps it on step 4. The step's update
is skipped by hand when the loss is not finite (as a loss scaler would), so the weights stay finite.
Writes ``OUT/info.json``: the localisations and the script's own float64 statistics of the poisoned
module's input at the dumped step.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
    os.environ.setdefault(key, value)

import deepspeed  # noqa: E402
import torch  # noqa: E402

from trainmon import TrainerMonitor  # noqa: E402

sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip the JIT build of the shared-memory op
INJECT_FROM, STEPS = 2, 5


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block() for _ in range(3)])
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main() -> None:
    out, stage = Path(sys.argv[1]), int(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = Net()
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    monitor = TrainerMonitor({"output_dir": str(out), "run_name": "run", "sinks": ["csv"],
                              "anomaly": {"detectors": [{"type": "nonfinite"}], "actions": ["jsonl", "dump"]},
                              "dump": {"enabled": True, "mode": "tensor", "depth": 0}})
    monitor.attach(engine)
    state = {"step": 0}
    inputs: list[list[float]] = []

    def inject(module, args, output):
        if state["step"] >= INJECT_FROM:
            output = output.clone()
            output[0, 0] = float("nan")
        if state["step"] == INJECT_FROM + 2:
            x = args[0].detach().double()
            inputs.append([x.max().item(), x.min().item(), x.mean().item(), x.norm().item()])
        return output

    handle = engine.module.layers[1].fc2.register_forward_hook(inject, prepend=True)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    for step in range(STEPS):
        state["step"] = step
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        if not torch.isfinite(loss):
            engine.zero_grad()  # skip the update, as a loss scaler would
            for p in engine.module.parameters():
                p.grad = None
        engine.step()
        monitor.step(loss=loss)
    handle.remove()
    dump = monitor._session.actions["dump"]
    localisations = [{k: v for k, v in vars(found).items() if k != "key"} for found in dump.localisations]
    finite = all(torch.isfinite(p).all() for p in engine.module.parameters())
    monitor.close()
    (out / "info.json").write_text(json.dumps({"localisations": localisations, "fc2_input": inputs,
                                               "weights_finite": bool(finite)}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
