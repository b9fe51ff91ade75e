"""Train TinyNet with DeepSpeed under ONE config, monitored by trainmon.

Run by tests/launch.py (``DeepSpeedCases``) as ``python ds_train.py OUT CASE`` on 1 or 2 local ranks
(``RANK``, ``WORLD_SIZE``, ``MASTER_PORT`` ... from the launcher; without them a world of one), one
process group per case, so a case that fails takes no other case with it. CASE is a JSON object
``{"name", "stage", "dtype" (fp32, bf16, fp16), "gas", "params", "nan_step", "nan_param", "activations",
"ref", "ranks", "interval", "scale_power"}``.
The case writes ``OUT/<name>/rank{R}/...``; ZeRO-0 fp32 cases also save numpy references of the
full reduced gradients and optimizer states (``OUT/<name>/ref_rank{R}.npz``). Every case also
writes ``OUT/<name>/extra_rank{R}.json``: the micro-step losses, and per step the collectives
trainmon issued (counted by wrapping ``torch.distributed``'s collectives for the whole run).
DeepSpeed's full-gather accessors (``safe_get_full_grad`` ...) raise for the whole run: trainmon
must never call them.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
if "RANK" not in os.environ:  # no launcher: a world of one on a free port (else DeepSpeed looks for MPI)
    with socket.socket() as _sock:
        _sock.bind(("127.0.0.1", 0))
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_sock.getsockname()[1]))

import deepspeed
import numpy as np
import torch

sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip the slow JIT build (ENV.md)

import trainmon  # noqa: E402
from tests.models import TinyNet, batch, loss_fn  # noqa: E402
from trainmon import TrainerMonitor  # noqa: E402

STEPS = 3
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
               "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
               "gather_object", "broadcast", "broadcast_object_list", "reduce", "gather", "scatter",
               "all_to_all", "all_to_all_single", "all_reduce_coalesced", "barrier", "send", "recv", "isend",
               "irecv", "_all_gather_base", "_reduce_scatter_base")
FULL_GATHERS = ("safe_get_full_grad", "safe_get_full_optimizer_state", "safe_get_full_fp32_param")
# The installed package's own directory, never a "/trainmon/" substring: a clone in a folder named
# trainmon (what `git clone` makes) has that substring in this script's path and in the venv's.
_PACKAGE_DIR = Path(trainmon.__file__).resolve().parent
_ENGINE_WRAPPER = _PACKAGE_DIR / "collect" / "step_hooks.py"  # StepWrapper.install().step


@functools.cache
def _in_package(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(_PACKAGE_DIR)


def _is_trainmon_frame(code) -> bool:
    """A frame of trainmon's code, other than the engine-step wrapper (which only calls DeepSpeed's step)."""
    if not _in_package(code.co_filename):
        return False
    return not (code.co_name == "step" and Path(code.co_filename).resolve() == _ENGINE_WRAPPER)


class CollectiveCounter:
    """Counts the torch.distributed collectives that trainmon causes, and those inside monitor.step().

    A collective is trainmon's when a trainmon frame is on its stack other than the engine-step
    wrapper itself (which only calls DeepSpeed's own step): trainmon's hooks, the monitor's end of
    step, or a DeepSpeed accessor that trainmon called.
    """

    def __init__(self) -> None:
        self.by_trainmon = 0
        self.in_monitor_step = 0
        self.inside_step = False
        for name in COLLECTIVES:
            original = getattr(torch.distributed, name, None)
            if original is not None:
                setattr(torch.distributed, name, self._wrap(original))

    def _wrap(self, original):
        def counted(*args, **kwargs):
            self.in_monitor_step += self.inside_step
            frame = sys._getframe(1)
            while frame is not None:
                if _is_trainmon_frame(frame.f_code):
                    self.by_trainmon += 1
                    break
                frame = frame.f_back
            return original(*args, **kwargs)
        return counted

    def take(self) -> tuple[int, int]:
        counts = (self.by_trainmon, self.in_monitor_step)
        self.by_trainmon = self.in_monitor_step = 0
        return counts


def _forbid_full_gathers() -> None:
    """Make DeepSpeed's per-parameter full gathers raise: trainmon must combine shard partials instead."""
    import deepspeed.utils
    import deepspeed.utils.tensor_fragment as fragment

    for name in FULL_GATHERS:
        def forbidden(*args, _name=name, **kwargs):
            raise AssertionError(f"trainmon called deepspeed.utils.{_name} (a full gather)")
        for namespace in (deepspeed.utils, fragment):
            setattr(namespace, name, forbidden)


def _hook_counts(engine) -> list[int]:
    counts = [len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in engine.modules()]
    counts += [len(p._post_accumulate_grad_hooks or {}) for p in engine.parameters()]
    return counts + [len(engine.optimizer.__dict__.get("_optimizer_step_pre_hooks", {}))]


def run_case(out: str, case: dict, counter: CollectiveCounter) -> None:
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = TinyNet()
    dtype = case.get("dtype", "fp32")
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": case.get("gas", 1),
              "zero_optimization": {"stage": case["stage"]}, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True, "weight_decay": 0.0}}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "fp16":  # hysteresis 1: the first overflow halves the scale at once
        config["fp16"] = {"enabled": True, "initial_scale_power": case.get("scale_power", 16), "hysteresis": 1}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    monitor = TrainerMonitor({"output_dir": out, "run_name": case["name"], "sinks": ["csv"],
                              "targets": {"params": case.get("params", ["*"])},
                              "activations": {"enabled": case.get("activations", False)},
                              "anomaly": {"actions": ["jsonl"]}, "params": {"enabled": True},
                              "optimizer_states": {"precursors": True},
                              "ranks": case.get("ranks"), "step_interval": case.get("interval", 1)})
    before = _hook_counts(engine)
    monitor.attach(engine)
    names = [n for n, _ in engine.module.named_parameters()]
    refs: dict[str, np.ndarray] = {}
    handles = []
    losses: list[list[float]] = []
    collectives: list[list[int]] = []  # per step: [by trainmon anywhere, inside monitor.step()]
    counter.take()
    for step in range(STEPS):
        losses.append([])
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
            counter.inside_step = True
            monitor.step(loss=loss)  # after every engine.step(): a micro-step loss, or the step's end
            counter.inside_step = False
            losses[-1].append(float(loss))
        collectives.append(list(counter.take()))
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
    os.makedirs(os.path.join(out, case["name"]), exist_ok=True)
    with open(os.path.join(out, case["name"], f"extra_rank{rank}.json"), "w") as handle:
        json.dump({"losses": losses, "collectives": collectives}, handle)
    if refs:
        np.savez(os.path.join(out, case["name"], f"ref_rank{rank}.npz"), names=np.array(names), **refs)
    torch.distributed.barrier()


def main() -> None:
    out, case = sys.argv[1], json.loads(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    _forbid_full_gathers()
    counter = CollectiveCounter()
    try:
        run_case(out, case, counter)
    finally:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
