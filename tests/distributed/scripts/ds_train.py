"""Train TinyNet with DeepSpeed under several configs in ONE process group, monitored by trainmon.

Run by tests/distributed/test_deepspeed.py as ``torchrun --nproc_per_node 2 ds_train.py OUT CASES``
where CASES is a JSON list of ``{"name", "stage", "dtype", "gas", "params", "nan_step"}``.
Each case writes ``OUT/<name>/rank{R}/...``; ZeRO-0 fp32 cases also save numpy references of the
full reduced gradients and optimizer states (``OUT/<name>/ref_rank{R}.npz``).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
    os.environ.setdefault(key, value)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import deepspeed  # noqa: E402

sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip the slow JIT build (ENV.md)

from tests.models import TinyNet, batch, loss_fn  # noqa: E402
from trainmon import TrainerMonitor  # noqa: E402

STEPS = 3


def _hook_counts(engine) -> list[int]:
    counts = [len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in engine.modules()]
    counts += [len(p._post_accumulate_grad_hooks or {}) for p in engine.parameters()]
    return counts + [len(engine.optimizer.__dict__.get("_optimizer_step_pre_hooks", {}))]


def run_case(out: str, case: dict) -> None:
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = TinyNet()
    dtype = case.get("dtype", "fp32")
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": case.get("gas", 1),
              "zero_optimization": {"stage": case["stage"]}, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True, "weight_decay": 0.0}}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    monitor = TrainerMonitor({"output_dir": out, "run_name": case["name"], "sinks": ["csv"],
                              "targets": {"params": case.get("params", ["*"])},
                              "activations": {"enabled": case.get("activations", False)},
                              "anomaly": {"actions": ["jsonl"]}, "params": {"enabled": True}})
    before = _hook_counts(engine)
    monitor.attach(engine)
    names = [n for n, _ in engine.module.named_parameters()]
    refs: dict[str, np.ndarray] = {}
    handles = []
    for step in range(STEPS):
        for micro in range(case.get("gas", 1)):
            if case.get("nan_step") == step and rank == 1 and micro == 0:
                target = dict(engine.module.named_parameters())[case["nan_param"]]
                handles.append(target.register_hook(lambda g: torch.full_like(g, float("nan"))))
            tokens, targets = batch(1000 * step + 10 * rank + micro)
            loss = loss_fn(engine, tokens, targets)
            engine.backward(loss)
            for handle in handles:
                handle.remove()
            handles.clear()
            if case.get("ref") and engine.is_gradient_accumulation_boundary():
                for name, p in engine.module.named_parameters():  # ZeRO-0: whole averaged gradients
                    refs[f"{step}/grad_reduced/{name}"] = p.grad.double().numpy().copy()
                    refs[f"{step}/param/{name}"] = p.detach().double().numpy().copy()
            engine.step()
        if case.get("ref"):
            for name, p in engine.module.named_parameters():
                state = engine.optimizer.state[p]
                refs[f"{step}/exp_avg/{name}"] = state["exp_avg"].double().numpy().copy()
                refs[f"{step}/exp_avg_sq/{name}"] = state["exp_avg_sq"].double().numpy().copy()
                refs[f"{step}/step/{name}"] = np.array(float(state["step"]))
                refs[f"{step}/param_after/{name}"] = p.detach().double().numpy().copy()
    monitor.close()
    monitor.close()  # idempotent
    assert "step" not in engine.__dict__, "the engine wrapper was not removed"
    assert _hook_counts(engine) == before, "hooks were left behind"  # DeepSpeed has hooks of its own
    if refs:
        np.savez(os.path.join(out, case["name"], f"ref_rank{rank}.npz"), names=np.array(names), **refs)
    torch.distributed.barrier()


def main() -> None:
    out, cases = sys.argv[1], json.loads(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        for case in cases:
            run_case(out, case)
    finally:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
