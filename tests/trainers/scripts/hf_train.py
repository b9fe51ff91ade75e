"""``transformers.Trainer`` with trainmon's callback in processes of its own: ``python hf_train.py OUT CASE``.

Run by tests/trainers/test_hf_trainer.py through ``tests/launch.run_ranks`` on 1 or 2 local ranks (gloo, CPU).
CASE is a JSON object ``{"name", "acc", "avg_tokens", "zero" (null, 2 or 3: DeepSpeed ZeRO stage),
"model" (gpt2 or nokwargs), "steps", "clip", "monitor" and "reference" (false: no trainmon, no reference
reads: for timing)}``. Writes
``OUT/<name>/tm/run/rank{R}/`` (trainmon) and ``OUT/<name>/ref_rank{R}.json``: the Trainer's
``log_history``, the rank's float64 token-loss sums and item counts per micro-batch, and per step the float64
norms of the gradients the optimizer used and (DeepSpeed) of ``exp_avg`` after the step, read by the test's own
callback: under DeepSpeed with ``safe_get_full_grad`` / ``safe_get_full_optimizer_state`` around
``engine.step()`` (accelerate runs ``engine.step()`` inside ``accelerator.backward``, so no Trainer event lies
between the backward and the step), else ``param.grad`` at ``on_pre_optimizer_step``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
if "RANK" not in os.environ:  # no launcher: a world of one on a free port (else DeepSpeed looks for MPI)
    with socket.socket() as _sock:
        _sock.bind(("127.0.0.1", 0))
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_sock.getsockname()[1]))

import numpy as np
import torch
import transformers

from tests.trainers.hf_common import LossReference, NoKwargsLM, PaddedTokens, gpt2
from trainmon.trainers.hf import TrainmonCallback


def _norm(tensor: torch.Tensor) -> float:
    return float(np.linalg.norm(tensor.detach().double().numpy().ravel()))


class Reference(transformers.TrainerCallback):
    """The test's own record of the gradients the optimizer used and (DeepSpeed) its exp_avg after the step."""

    def __init__(self, trainer_box: list, read_tensors: bool = True) -> None:
        self.trainer_box, self.read_tensors = trainer_box, read_tensors
        self.grads: dict[int, dict[str, float]] = {}
        self.exp_avg: dict[int, dict[str, float]] = {}
        self.step_seconds: list[float] = []
        self._t = 0.0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        trainer = self.trainer_box[0]
        if not trainer.is_deepspeed_enabled or not self.read_tensors:
            return
        from deepspeed.utils import safe_get_full_grad, safe_get_full_optimizer_state

        engine = trainer.model_wrapped
        inner = engine.step  # trainmon's wrapper (its callback ran first): ours reads before it and after it

        def step(*a, **k):
            if not engine.is_gradient_accumulation_boundary():
                return inner(*a, **k)
            n = engine.global_steps + 1
            self.grads[n] = {name: _norm(safe_get_full_grad(p)) for name, p in engine.module.named_parameters()}
            result = inner(*a, **k)
            self.exp_avg[n] = {name: _norm(safe_get_full_optimizer_state(p, "exp_avg"))
                               for name, p in engine.module.named_parameters()}
            return result

        engine.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.read_tensors and not self.trainer_box[0].is_deepspeed_enabled:
            self.grads[state.global_step + 1] = {n: _norm(p.grad) for n, p in model.named_parameters()
                                                 if p.grad is not None}

    def on_step_end(self, args, state, control, **kwargs):
        self.step_seconds.append(time.perf_counter() - self._t)

    def on_train_end(self, args, state, control, **kwargs):
        engine = self.trainer_box[0].model_wrapped
        engine.__dict__.pop("step", None) if self.trainer_box[0].is_deepspeed_enabled else None


def main() -> None:
    out, case = Path(sys.argv[1]), json.loads(sys.argv[2])
    rank = int(os.environ["RANK"])
    if case.get("zero") is not None:
        import deepspeed

        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip the slow JIT build (ENV.md)
        deepspeed.init_distributed(dist_backend="gloo")
    run = out / case["name"]
    torch.manual_seed(0)
    model = gpt2() if case.get("model", "gpt2") == "gpt2" else NoKwargsLM()
    losses = LossReference(model)
    ds_config = None
    if case.get("zero") is not None:
        ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                     "gradient_clipping": "auto", "zero_optimization": {"stage": case["zero"]},
                     "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}}}
    args = transformers.TrainingArguments(
        output_dir=str(run / "hf"), max_steps=case.get("steps", 3), per_device_train_batch_size=4,
        gradient_accumulation_steps=case["acc"], learning_rate=1e-3, max_grad_norm=case.get("clip", 0.05),
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, seed=0, average_tokens_across_devices=case["avg_tokens"], deepspeed=ds_config,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 and ds_config is None else None)
    box: list = []
    reference = Reference(box, read_tensors=case.get("reference", True))
    monitor_config = {"output_dir": str(run / "tm"), "run_name": "run", "sinks": ["csv", "parquet"],
                      "weight_grads": {"metrics": ["norm"]},
                      "optimizer_states": {"states": ["exp_avg"], "metrics": ["norm"]}}
    callbacks = ([TrainmonCallback(monitor_config)] if case.get("monitor", True) else []) + [reference]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=PaddedTokens(256, 1), callbacks=callbacks)
    box.append(trainer)
    trainer.train()
    losses.handle.remove()
    (run / f"ref_rank{rank}.json").write_text(json.dumps({
        "log_history": trainer.state.log_history, "micro": losses.micro, "grads": reference.grads,
        "exp_avg": reference.exp_avg, "step_seconds": reference.step_seconds}))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
