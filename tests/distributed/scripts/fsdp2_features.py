"""Dump, free benchmark and grad probe on an FSDP2 (``fully_shard``) model, on gloo CPU ranks.

``python fsdp2_features.py OUT CASE [CASE ...]`` on 2 ranks (launched by ``tests/launch.py``). Each case
writes ``OUT/<case>/rank{R}/...`` (trainmon) and the test's own references, taken from a plain unsharded
copy of the model that runs each rank's data beside the FSDP model (its parameters loaded from
``full_tensor()`` at every step):

- ``actions``: ``blocks.0``, ``blocks.1`` and ``head`` are ``fully_shard``ed (``blocks.1.fc2`` too, nested in
  ``blocks.1``), then the root. ``monitor.dump(["blocks.1", "blocks.1.*"])`` at step 1 (tensor mode),
  ``monitor.free_benchmark`` (``change_value``) of ``blocks.0``, ``blocks.1``, ``blocks.1.fc1`` and
  ``blocks.1.fc2`` at step 1, and a NaN in ``blocks.1.fc1``'s output from step ``INJECT`` on (the loss is
  the first origin: localised on the next step, dumped on the one after). Steps with a non-finite loss
  skip the optimizer. Writes ``refs_rank{R}.npz`` (``{step}|{module}|input|output``,
  ``{step}|{param}|param|grad``: the reference's tensors in float64) and ``info_rank{R}.json`` (free
  benchmark results, the references' max ratios, localisations, warnings, collectives, hooks left).
"""

from __future__ import annotations

import copy
import json
import logging
import sys
from pathlib import Path

import fsdp2_train  # the FSDP2 worker beside this script (its folder is sys.path[0]): model, data, helpers
import numpy as np
import torch
import torch.distributed as dist
from fsdp2_train import Warnings, data
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from trainmon import TrainerMonitor

STEPS, INJECT = 6, 2
ACTION_STEP = 1
CHECKED = ["blocks.0", "blocks.1", "blocks.1.fc1", "blocks.1.fc2"]
WATCHED = ["blocks.0", "blocks.1", "blocks.1.norm", "blocks.1.fc1", "blocks.1.act", "blocks.1.fc2"]


class PoisonLinear(nn.Linear):
    """A linear layer that puts a NaN into its output while ``poison`` is set."""

    poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.poison:
            out = out * torch.where(torch.arange(out.shape[-1]) == 3, float("nan"), 1.0)
        return out


class Block(fsdp2_train.Block):
    """``fsdp2_train``'s pre-norm residual MLP block with a poisonable ``fc1``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = PoisonLinear(self.fc1.in_features, self.fc1.out_features)


class Net(fsdp2_train.Net):
    """``fsdp2_train``'s model (odd sizes: uneven shards, an empty shard of ``head``) with poisonable blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])


def max_ratio64(original: np.ndarray, perturbed: np.ndarray, tol: float = 1e-4) -> float:
    """msprobe's elementwise ratio check in float64 (the free benchmark's rule, written independently)."""
    a, b = np.abs(original), np.abs(perturbed)
    big = np.maximum(a, b)
    ratio = np.where(big <= tol, 1.0, big / np.maximum(np.minimum(a, b), tol))
    ratio = np.where((original * perturbed < 0) & (big > tol), np.inf, ratio)
    return float(ratio.max())


def swap_first_last(x: torch.Tensor) -> torch.Tensor:
    flat = x.detach().clone().reshape(-1)
    flat[0], flat[-1] = flat[-1].clone(), flat[0].clone()
    return flat.reshape(x.shape)


def _hook_count(model: nn.Module) -> int:
    return sum(len(getattr(m, attr)) for m in model.modules()
               for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))


def run_actions(out: Path, warnings: Warnings) -> None:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    net = Net()
    reference = copy.deepcopy(net)  # plain and unsharded, on this rank's data: the test's truth
    fully_shard(net.blocks[0], mesh=mesh)
    fully_shard(net.blocks[1].fc2, mesh=mesh)  # nested: resharded before blocks.1's forward returns
    fully_shard(net.blocks[1], mesh=mesh)
    fully_shard(net.head, mesh=mesh)
    fully_shard(net, mesh=mesh)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    hooks_before = _hook_count(net)
    monitor = TrainerMonitor({
        "output_dir": str(out), "run_name": "actions", "sinks": ["csv"],
        "dump": {"enabled": True, "mode": "tensor"},
        "free_benchmark": {"enabled": True, "pert_mode": "change_value", "max_per_step": 8},
        "anomaly": {"detectors": [{"type": "nonfinite"}], "actions": ["jsonl", "dump"]}})
    monitor.attach(net, optimizer)
    monitor.dump(["blocks.1", "blocks.1.*"], steps=[ACTION_STEP])
    monitor.free_benchmark(CHECKED, steps=[ACTION_STEP])
    refs: dict[str, np.ndarray] = {}
    ratios: dict[str, float] = {}
    modules = dict(reference.named_modules())

    rerunning = []  # the float64 re-run below runs a copy that carries these hooks too

    def capture(step: int, name: str):
        def hook(module, args, output):
            if rerunning:
                return
            refs[f"{step}|{name}|input"] = args[0].detach().double().numpy().copy()
            refs[f"{step}|{name}|output"] = output.detach().double().numpy().copy()
            if step == ACTION_STEP and name in CHECKED:  # the free benchmark's re-run, in float64
                rerunning.append(name)
                with torch.no_grad():
                    perturbed = copy.deepcopy(module).double()(swap_first_last(args[0]).double())
                rerunning.pop()
                ratios[name] = max_ratio64(output.detach().double().numpy(), perturbed.numpy())
        return hook

    for step in range(STEPS):
        reference.load_state_dict({name: p.full_tensor() for name, p in net.named_parameters()})
        for name, p in reference.named_parameters():
            refs[f"{step}|{name}|param"] = p.detach().double().numpy().copy()
        poison = step >= INJECT
        net.blocks[1].fc1.poison = reference.blocks[1].fc1.poison = poison
        handles = [modules[name].register_forward_hook(capture(step, name)) for name in WATCHED]
        x, y = data(1000 * rank + step)  # different data on each rank
        reference.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        for handle in handles:
            handle.remove()
        for name, p in reference.named_parameters():
            refs[f"{step}|{name}|grad"] = p.grad.double().numpy().copy()
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        if torch.isfinite(loss):  # as a loss scaler would: a non-finite step is not applied
            optimizer.step()
        optimizer.zero_grad()
        monitor.step(loss=loss)
    session = monitor._session
    dump, bench = session.actions["dump"], session.actions["free_benchmark"]
    dump.flush()
    bench.flush()
    results = [{"step": r.step, "name": r.name, "index": r.output_index, "max_rel": r.max_rel, "passed": r.passed}
               for r in bench.results]
    localisations = [{k: v for k, v in vars(found).items() if k not in ("key", "fallback")}
                     for found in dump.localisations]
    monitor.close()
    case_dir = out / "actions"
    np.savez(case_dir / f"refs_rank{rank}.npz", **refs)
    (case_dir / f"info_rank{rank}.json").write_text(json.dumps({
        "results": results, "ratios": ratios, "localisations": localisations, "warnings": warnings.messages,
        "hooks_left": _hook_count(net) != hooks_before}, default=str))


PROBE_STEPS, PROBE_INTERVAL, MAX_NORM = 5, 2, 0.5
PROBE_CONFIG = {"bounds": [-0.01, 0.0, 0.01], "scalars": "param"}


def _train_probe(net: nn.Module, monitor: TrainerMonitor, batches, refs: dict[str, np.ndarray] | None,
                 counter: fsdp2_train.CollectiveCounter | None = None) -> list[int]:
    """Adam with clipping; the gradients and ``exp_avg`` the optimizer finds (full, float64) into ``refs``."""
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    names = {id(p): name for name, p in net.named_parameters()}
    step_of = {"step": 0}

    def pre_hook(opt, args, kwargs):  # registered before attach: runs before the probe's own pre-hook
        for p in (p for group in opt.param_groups for p in group["params"]):
            refs[f"{step_of['step']}|grad|{names[id(p)]}"] = fsdp2_train._full64(p.grad)
            if "exp_avg" in opt.state.get(p, {}):
                refs[f"{step_of['step']}|exp_avg|{names[id(p)]}"] = fsdp2_train._full64(opt.state[p]["exp_avg"])

    handle = optimizer.register_step_pre_hook(pre_hook) if refs is not None else None
    monitor.attach(net, optimizer)
    collectives = []
    if counter is not None:
        counter.take()
    for step in range(PROBE_STEPS):
        step_of["step"] = step
        x, y = batches(step)
        nn.functional.mse_loss(net(x), y).backward()
        nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        monitor.step()
        if counter is not None:
            collectives.append(counter.take())
    monitor.close()
    if handle is not None:
        handle.remove()
    return collectives


def run_probe(out: Path, warnings: Warnings, case: str, counter: fsdp2_train.CollectiveCounter) -> None:
    """FSDP2 (``probe``: ``Shard(0)``, every weight family on; ``probe_dim1``: matrices ``Shard(1)``, grad probe
    only; ``probe_dim1_store``: the same into the run store (``sinks: [parquet]``); ``probe_l0``: ``Shard(0)``,
    level L0; ``probe_hsdp_2x1``: HSDP, 2 replicas of 1 shard) on each rank's
    5 rows; then, on rank 0, ``probe_plain``: the
    unsharded model on both ranks' 10 rows (L2)."""
    rank = dist.get_rank()
    if case == "probe_hsdp_2x1":  # replicas of whole tensors: no shard to combine, each rank writes its own
        mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    net = fsdp2_train.Net()
    placement = (lambda p: Shard(1) if p.ndim == 2 else None) if case.startswith("probe_dim1") else None
    for block in net.blocks:
        fully_shard(block, mesh=mesh, shard_placement_fn=placement)
    fully_shard(net, mesh=mesh, shard_placement_fn=placement)
    weights = case == "probe"
    sinks = ["parquet"] if case.endswith("_store") else ["csv"]  # the run store, or the per-file layout
    config = {"output_dir": str(out), "run_name": case, "sinks": sinks, "step_interval": PROBE_INTERVAL,
              "grad_probe": {"enabled": True, **PROBE_CONFIG, "level": "L0" if case == "probe_l0" else "L2"},
              "weight_grads": {"enabled": weights},
              "optimizer_states": {"enabled": weights}, "anomaly": {"actions": []}}
    refs: dict[str, np.ndarray] = {}
    collectives = _train_probe(net, TrainerMonitor(config), lambda step: data(1000 * rank + step), refs, counter)
    case_dir = out / case
    np.savez(case_dir / f"refs_rank{rank}.npz", **refs)
    (case_dir / f"info_rank{rank}.json").write_text(json.dumps({"collectives": collectives,
                                                                 "warnings": warnings.messages}))
    if rank == 0 and case not in ("probe_l0", "probe_dim1_store") and not (out / "probe_plain").exists():
        torch.manual_seed(0)
        plain = fsdp2_train.Net()

        def both(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            parts = [data(1000 * r + step) for r in range(dist.get_world_size())]
            return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

        _train_probe(plain, TrainerMonitor({**config, "run_name": "probe_plain"}), both, None)
    dist.barrier()


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    warnings = Warnings()
    logging.getLogger("trainmon").addHandler(warnings)
    counter = fsdp2_train.CollectiveCounter()  # counts the collectives issued from trainmon's frames
    try:
        for case in cases:
            warnings.messages.clear()
            if case == "actions":
                run_actions(out, warnings)
            else:
                run_probe(out, warnings, case, counter)
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
