"""The step guard under DeepSpeed, against runs that leave the poisoned batch out (``anomaly.guard``).

Run by tests/launch.py (``DeepSpeedCases``) as ``python ds_guard_run.py OUT CASE`` on 1 or 2 ranks. CASE is a JSON
object ``{"name", "stage", "dtype" (fp32, bf16), "gas", "accum" (the gradient-accumulation dtype), "unguarded",
"refusals", "reads"}``.

One process trains TinyNet several times under the same DeepSpeed config (AdamW, a WarmupLR scheduler, ``gas``
micro-batches per step), each run from the same seed:

- ``reference``: written as a user would skip a batch: at step ``BAD`` no forward, backward or ``engine.step()``.
- ``nan``: guarded; at step ``BAD`` the last micro-batch's gradient of ``layers.1.fc2.weight`` gets a NaN in one
  entry (a tensor hook), on the last rank only.
- ``spike``: guarded; at step ``BAD`` the loss of every micro-batch is multiplied by 10, on rank 0 only.
- with ``unguarded``: the same two poisons without trainmon (to show they would change the run), and
  ``failing_spike``: the spike, guarded, with trainmon's guard code raising from step ``BAD`` on (tests/faults.py):
  the step is applied as without the guard.

After each run the script gathers what DeepSpeed holds (every rank joins the gathers): the module's parameters, the
fp32 master weights and the Adam states through ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``
(ZeRO 1-3; under ZeRO-0 the torch optimizer's own, keyed by the parameter or its fp32 copy), every tensor of the
inner torch optimizer's state (flat partitions, step counts) and the learning rates, and writes
``OUT/<name>/result_rank{R}.json``: per run, the names of the tensors that differ from the reference
(``torch.equal``), ``skipped_steps``, ``global_steps``, whether every parameter is finite, and on applied steps the
guard's global norm with DeepSpeed's; with ``refusals`` the messages of set-ups refused at attach, with ``reads``
the host-synchronising calls per step with the guard off and on.
"""

from __future__ import annotations

import importlib
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
import torch

sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip the slow JIT build (ENV.md)

from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

from tests.models import TinyNet, batch, loss_fn  # noqa: E402
from trainmon import TrainerMonitor  # noqa: E402

STEPS, BAD = 9, 6
GUARD = {"enabled": True, "window": 8, "warmup": 4}
NAN_PARAM = "layers.1.fc2.weight"


def _nan_in_one_entry(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = float("nan")
    return grad


def _config(case: dict, gas: int) -> dict:
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
              "zero_optimization": {"stage": case["stage"]}, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True, "weight_decay": 0.01}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": STEPS, "warmup_type": "linear"}}}
    if case.get("dtype") == "bf16":
        config["bf16"] = {"enabled": True}
    if case.get("accum"):
        config["data_types"] = {"grad_accum_dtype": case["accum"]}
    return config


def train(case: dict, out: str, mode: str) -> dict:
    """One run (``reference``, ``nan``, ``spike``, ``unguarded_nan``, ``unguarded_spike``); returns its state."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = TinyNet()
    gas = case.get("gas", 2)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(case, gas))
    monitor = None
    if mode in ("nan", "spike", "failing_spike"):
        monitor = TrainerMonitor({"output_dir": out, "run_name": f"{case['name']}_{mode}", "sinks": ["csv"],
                                  "step_interval": 2, "anomaly": {"guard": GUARD, "actions": ["jsonl"]}})
        monitor.attach(engine)
    poison = mode.removeprefix("unguarded_").removeprefix("failing_")
    norms: list[list[float]] = []  # on applied steps: [the guard's global norm, DeepSpeed's]
    try:
        for step in range(STEPS):
            if mode == "reference" and step == BAD:
                continue  # the user's way to leave the batch out
            for micro in range(gas):
                tokens, targets = batch(1000 * step + 10 * rank + micro)
                loss = loss_fn(engine, tokens, targets)
                if poison == "spike" and step == BAD and rank == 0:
                    loss = loss * 10
                handle = None
                if poison == "nan" and step == BAD and micro == gas - 1 and rank == world - 1:
                    handle = dict(engine.module.named_parameters())[NAN_PARAM].register_hook(_nan_in_one_entry)
                engine.backward(loss)
                if handle is not None:
                    handle.remove()
                engine.step()
                if monitor is not None:
                    verdict = monitor._session.step_guard.verdict  # this step's, until monitor.step() takes it
                    if verdict is not None and engine.was_step_applied() and engine.get_global_grad_norm() is not None:
                        norms.append([float(verdict[6]), float(engine.get_global_grad_norm())])
                    monitor.step(loss=loss)
    finally:
        if monitor is not None:
            monitor.close()
            monitor.close()  # idempotent
    left = {"step", "scaled_global_norm", "_get_norm_groups", "get_grads_for_norm"} & set(engine.optimizer.__dict__)
    if isinstance(engine.optimizer, torch.optim.Optimizer):  # ZeRO-0 fp32: the attribute the guard sets there
        left |= {"overflow"} & set(engine.optimizer.__dict__)
    checker = getattr(engine.optimizer, "overflow_checker", None)
    left |= {"check"} & set(getattr(checker, "__dict__", {}))
    assert not left, f"the step guard left {left} behind"
    state = _state(engine, case["stage"])
    state["skipped_steps"] = engine.skipped_steps
    state["global_steps"] = engine.global_steps
    state["norms"] = norms
    engine.destroy()
    return state


def _inner(engine) -> torch.optim.Optimizer:
    optimizer = engine.optimizer
    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _state(engine, stage: int) -> dict:
    """Every tensor DeepSpeed keeps for the model (gathered where it is partitioned), by name."""
    tensors: dict[str, torch.Tensor] = {}
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=stage == 3):
        for name, param in params:
            tensors[f"module/{name}"] = param.detach().clone()
    inner = _inner(engine)
    if stage > 0:
        for name, param in params:
            tensors[f"fp32/{name}"] = safe_get_full_fp32_param(param)
            for key in ("exp_avg", "exp_avg_sq"):
                tensors[f"{key}/{name}"] = safe_get_full_optimizer_state(param, key)
    else:  # ZeRO-0: the torch optimizer's own state, keyed by the parameter or its fp32 copy (bf16)
        fp32 = getattr(engine.optimizer, "fp32_groups", None)
        masters = [q for group in fp32 for q in group] if fp32 is not None else [p for _, p in params]
        for (name, _), master in zip(params, masters):
            tensors[f"fp32/{name}"] = master.detach().clone()
            for key, value in inner.state[master].items():
                tensors[f"{key}/{name}"] = torch.as_tensor(value).clone()
    for i, state in enumerate(inner.state.values()):  # flat partitions under ZeRO; the step counts
        for key, value in state.items():
            tensors[f"inner/{i}/{key}"] = torch.as_tensor(value).clone()
    tensors["lr"] = torch.tensor([group["lr"] for group in inner.param_groups], dtype=torch.float64)
    return {"tensors": tensors, "finite": all(bool(torch.isfinite(t).all()) for n, t in tensors.items()
                                              if n.startswith(("module/", "fp32/")))}


REFUSED = {  # set-ups DeepSpeed's skip path would not hold back exactly: refused at attach
    "bf16_no_overflow_check": {"zero_optimization": {"stage": 2},
                               "bf16": {"enabled": True, "check_grad_overflow": False}},
    "no_grad_norm": {"zero_optimization": {"stage": 1, "compute_grad_norm": False}, "gradient_clipping": 0.0},
}


def refusals(out: str) -> dict[str, str]:
    """The message of each refused set-up, and whether the engine was left as it was."""
    from trainmon.errors import UnsupportedSetupError

    messages = {}
    for name, extra in REFUSED.items():
        torch.manual_seed(0)
        model = TinyNet()
        config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10 ** 6,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}, **extra}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        monitor = TrainerMonitor({"output_dir": out, "run_name": f"refused_{name}", "anomaly": {"guard": GUARD}})
        try:
            monitor.attach(engine)
            messages[name] = "not refused"
        except UnsupportedSetupError as exc:
            messages[name] = str(exc)
        assert "step" not in engine.__dict__ and "step" not in engine.optimizer.__dict__
        engine.destroy()
    return messages


SYNCS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__")


def host_reads(case: dict, out: str, guarded: bool) -> list[int]:
    """Per step, the host-synchronising tensor calls of the whole training step (DeepSpeed's own included), with a
    monitor that collects only step 0 and the guard on or off (``numpy()`` of a CPU tensor is a view, not counted)."""
    torch.manual_seed(0)
    model = TinyNet()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(case, 1))
    monitor = TrainerMonitor({"output_dir": out, "run_name": f"{case['name']}_reads_{guarded}", "sinks": ["csv"],
                              "step_interval": 1000, "anomaly": {"guard": {**GUARD, "enabled": guarded}}})
    monitor.attach(engine)
    counts: list[int] = []
    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def counting(name):
        def call(tensor, *args, **kwargs):
            counts[-1] += 1
            return originals[name](tensor, *args, **kwargs)
        return call

    try:
        for step in range(4):
            counts.append(0)
            for name in SYNCS:
                setattr(torch.Tensor, name, counting(name))
            try:
                loss = loss_fn(engine, *batch(step))
                engine.backward(loss)
                engine.step()
                monitor.step(loss=loss)
            finally:
                for name, original in originals.items():
                    setattr(torch.Tensor, name, original)
    finally:
        monitor.close()
        engine.destroy()
    return counts


def _differ(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    return sorted(name for name in expected if name not in tensors or not torch.equal(tensors[name], expected[name]))


def main() -> None:
    out, case = sys.argv[1], json.loads(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    try:
        modes = ["reference", "nan", "spike"] + (["unguarded_nan", "unguarded_spike"] if case.get("unguarded") else [])
        states = {mode: train(case, out, mode) for mode in modes}
        if case.get("unguarded"):
            from tests.faults import FAULTS, inject

            fault = FAULTS["deepspeed_step_guard"]
            owner = getattr(importlib.import_module(fault.module), fault.owner)
            original = getattr(owner, fault.attribute)
            inject("deepspeed_step_guard", after=BAD + 1)  # the decision of step BAD raises
            try:
                states["failing_spike"] = train(case, out, "failing_spike")
            finally:
                setattr(owner, fault.attribute, original)
        reference = states["reference"]["tensors"]
        result = {}
        for mode, state in states.items():
            tensors = state["tensors"]
            result[mode] = {"differ": _differ(tensors, reference),
                            "compared": len(reference), "skipped_steps": state["skipped_steps"],
                            "global_steps": state["global_steps"], "finite": state["finite"],
                            "norms": state["norms"]}
            if "unguarded_spike" in states:
                result[mode]["differ_unguarded_spike"] = _differ(tensors, states["unguarded_spike"]["tensors"])
        if case.get("refusals"):
            result["refusals"] = refusals(out)
        if case.get("reads"):
            result["host_reads"] = {"plain": host_reads(case, out, False), "guarded": host_reads(case, out, True)}
        Path(out, case["name"]).mkdir(parents=True, exist_ok=True)
        Path(out, case["name"], f"result_rank{rank}.json").write_text(json.dumps(result, indent=1))
    finally:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
