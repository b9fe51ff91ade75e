"""Train a small ``PipelineModule`` with DeepSpeed's ``PipelineEngine`` (``engine.train_batch``), PP=2.

Run by tests/launch.py (``DeepSpeedCases``) as ``python ds_pipe_train.py OUT CASE`` on 2 local ranks (one
pipeline stage each, gloo on CPU). CASE is a JSON object ``{"name", "stage" (ZeRO 0 or 1), "gas", "monitor"
(false: the same run without trainmon), "grad_hooks" (module or tensor), "user_step" (call
``monitor.step(loss=loss)`` after each ``train_batch``; else the monitor ends its steps by itself), "steps",
"ranks", "interval" (the monitor's ``ranks`` and ``step_interval``)}``.

The model has a weight tied across the two stages (``TiedLayerSpec``, as an embedding tied to the output
layer): DeepSpeed all-reduces its gradient over the stages, and counts it once in its gradient norm.

References, taken by this script with public APIs only and saved to ``OUT/<name>/ref_rank{R}.npz``:

- the gradient the optimizer steps with: ``deepspeed.utils.safe_get_full_grad(p)`` when the engine's optimizer
  steps (``train_batch`` runs the schedule, reduces the gradients and steps the optimizer inside one call):
  under ZeRO-0 in a step pre-hook of that torch optimizer; under ZeRO-1 in a wrapper of the ZeRO optimizer's
  ``step`` on its instance (it has no step hooks, and it frees the gradient partitions before it steps the
  torch optimizer inside);
- the parameters before that step and after ``train_batch``; the Adam states after it
  (``engine.optimizer.state`` under ZeRO-0, ``safe_get_full_optimizer_state`` under ZeRO-1) and the step count;
- the loss ``train_batch`` returned, and ``engine.get_global_grad_norm()`` (None when DeepSpeed computes none);
- activation gradients: this script's own forward hooks put a tensor hook on each module's output, tagged with
  the micro-batch of that forward (the k-th forward of the step); the hook stores the gradient's norm.
``OUT/<name>/times_rank{R}.json`` holds the wall time of each ``train_batch``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import numpy as np
import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip the slow JIT build (ENV.md)

from trainmon import TrainerMonitor  # noqa: E402

D = 8
MICRO_BATCH = 4


def build_model() -> PipelineModule:
    torch.manual_seed(0)
    layers = [TiedLayerSpec("embed", torch.nn.Linear, D, D, bias=False),   # stage 0: layers 0-2
              LayerSpec(torch.nn.Linear, D, 2 * D), LayerSpec(torch.nn.GELU),
              LayerSpec(torch.nn.Linear, 2 * D, D),                          # stage 1: layers 3-5
              TiedLayerSpec("embed", torch.nn.Linear, D, D, bias=False), LayerSpec(torch.nn.Linear, D, 1)]
    return PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform",
                          seed_layers=True, base_seed=1234)


def data(seed: int):
    """The same batches on every stage (the first stage reads the inputs, the last the labels)."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(MICRO_BATCH, D, generator=generator)
        yield x, x.sum(1, keepdim=True).tanh()


def inner_optimizer(engine) -> torch.optim.Optimizer:
    optimizer = engine.optimizer
    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


class ActivationGradients:
    """Norms of each module's output gradient, keyed by (step, micro-batch of the forward that made the tensor)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.step = 0
        self.forwards: dict[str, int] = {}
        self.norms: dict[str, float] = {}
        self.handles = [m.register_forward_hook(self._forward(name))
                        for name, m in module.named_modules() if name]

    def new_step(self, step: int) -> None:
        self.step, self.forwards = step, {}

    def _forward(self, name: str):
        def hook(module, args, output) -> None:
            if not (torch.is_grad_enabled() and module.training and output.requires_grad):
                return
            micro = self.forwards.get(name, 0)
            self.forwards[name] = micro + 1
            key = f"{self.step}/{micro}/{name}.output_grad"
            output.register_hook(lambda grad: self.norms.__setitem__(
                key, float(np.linalg.norm(grad.detach().double().numpy()))))
        return hook


def _hook_counts(engine) -> list[int]:
    counts = [len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) + len(m._backward_pre_hooks)
              for m in engine.modules()]
    counts += [len(p._post_accumulate_grad_hooks or {}) for p in engine.parameters()]
    return counts + [len(inner_optimizer(engine)._optimizer_step_pre_hooks)]


def run_case(out: str, case: dict) -> None:
    rank = torch.distributed.get_rank()
    gas, steps = case.get("gas", 2), case.get("steps", 3)
    model = build_model()
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": gas,
              "zero_optimization": {"stage": case["stage"]}, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True, "weight_decay": 0.0}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()], config=config)
    names = [n for n, _ in engine.module.named_parameters()]
    refs: dict[str, np.ndarray] = {}
    activation_grads = ActivationGradients(engine.module)
    stepping = {"step": 0}

    def before_step(optimizer, args, kwargs) -> None:  # between DeepSpeed's reduction and its optimizer step
        step = stepping["step"]
        for name, p in engine.module.named_parameters():
            refs[f"{step}/grad/{name}"] = deepspeed.utils.safe_get_full_grad(p).double().numpy().copy()
            refs[f"{step}/param/{name}"] = p.detach().double().numpy().copy()

    if case["stage"] == 0:  # the torch optimizer itself
        reference_hook = engine.optimizer.register_step_pre_hook(before_step)
    else:  # ZeRO's wrapper has no step hooks, and frees the gradient partitions before the inner torch step
        zero_step = engine.optimizer.step

        def step_with_reference(*args, **kwargs):
            before_step(engine.optimizer, args, kwargs)
            return zero_step(*args, **kwargs)

        engine.optimizer.step = step_with_reference
        reference_hook = SimpleNamespace(remove=lambda: engine.optimizer.__dict__.pop("step"))
    monitor = None
    hooks_before = _hook_counts(engine)
    if case.get("monitor", True):
        monitor = TrainerMonitor({"output_dir": out, "run_name": case["name"], "sinks": ["csv"],
                                  "activations": {"enabled": True, "grad_hooks": case.get("grad_hooks", "module")},
                                  "params": {"enabled": True}, "anomaly": {"actions": ["jsonl"]},
                                  "ranks": case.get("ranks"), "step_interval": case.get("interval", 1)})
        monitor.attach(engine)
    batches = data(seed=7)
    times, losses, norms, pp_stages = [], [], [], []
    for step in range(steps):
        stepping["step"] = step
        activation_grads.new_step(step)
        start = time.perf_counter()
        loss = engine.train_batch(batches)
        if case.get("user_step"):
            record = monitor.step(loss=loss)
            pp_stages.append(record.pp_stage)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        norm = engine.get_global_grad_norm()
        norms.append(float("nan") if norm is None else float(norm))
        for name, p in engine.module.named_parameters():
            for key in ("exp_avg", "exp_avg_sq"):
                if case["stage"] == 0:
                    state = engine.optimizer.state[p][key]
                else:
                    state = deepspeed.utils.safe_get_full_optimizer_state(p, key)
                refs[f"{step}/{key}/{name}"] = state.double().numpy().copy()
            refs[f"{step}/param_after/{name}"] = p.detach().double().numpy().copy()
        refs[f"{step}/adam_step"] = np.array(float(next(iter(inner_optimizer(engine).state.values()))["step"]))
    if monitor is not None:
        monitor.close()
        monitor.close()  # idempotent
        leftover = [n for n in ("train_batch", "_take_model_step", "step") if n in engine.__dict__]
        assert not leftover, f"engine wrappers left behind: {leftover}"
        assert _hook_counts(engine) == hooks_before, "hooks left behind"
    reference_hook.remove()
    for handle in activation_grads.handles:
        handle.remove()
    directory = os.path.join(out, case["name"])
    os.makedirs(directory, exist_ok=True)
    np.savez(os.path.join(directory, f"ref_rank{rank}.npz"), names=np.array(names),
             replicated=np.array([bool(getattr(p, "ds_pipe_replicated", False))
                                  for p in engine.module.parameters()]), **refs)
    with open(os.path.join(directory, f"extra_rank{rank}.json"), "w") as handle:
        json.dump({"times": times, "losses": losses, "grad_norms": norms, "stage_id": engine.stage_id,
                   "activation_grads": activation_grads.norms, "pp_stages": pp_stages}, handle)


def main() -> None:
    out, case = sys.argv[1], json.loads(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        run_case(out, case)
    finally:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
