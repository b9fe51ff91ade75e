"""Train a small model sharded with FSDP2 (``fully_shard``) on gloo CPU ranks, monitored by trainmon.

``python fsdp2_train.py OUT CASE [CASE ...]`` on 2 ranks (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT`` ... from
the launcher), one process group for all cases, one fresh model and monitor per case. CASE is ``fsdp``
(a 1-D mesh), ``fsdp_nosync`` (the same, with FSDP's gradient reduction skipped on the first micro-step
(``set_requires_gradient_sync(False)``) and ``ranks: [1]``), or ``hsdp_RxS`` (a 2-D replicate x shard mesh,
e.g. ``hsdp_1x2`` (with the matrices sharded on dim 1), ``hsdp_2x1``).
Each case writes ``OUT/<case>/rank{R}/...`` (trainmon) and ``OUT/<case>/ref_rank{R}.npz``: the test's own
float64 references, taken from ``full_tensor()`` of the tensors the optimizer used (its own optimizer
step pre/post hooks) and from a plain copy of the model for each rank's local gradient; and
``OUT/<case>/extra_rank{R}.json``: per step the collectives issued from trainmon's frames, trainmon's
warnings, and whether hooks were left behind.

``python fsdp2_train.py OUT unsupported`` (one process, a world of one): layouts that must fail at attach;
writes ``OUT/unsupported.json`` with each case's error.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import socket
import sys
from pathlib import Path

if "RANK" not in os.environ:  # no launcher: a world of one on a free port
    with socket.socket() as _sock:
        _sock.bind(("127.0.0.1", 0))
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_sock.getsockname()[1]))

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

import trainmon
from trainmon import TrainerMonitor

STEPS, MICRO, INTERVAL, MAX_NORM = 4, 2, 2, 0.5
STATES = ["exp_avg", "exp_avg_sq", "update", "ratio"]
METRICS = ["norm", "min", "max", "mean", "zeros", "nans", "infs"]
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
               "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
               "gather_object", "broadcast", "broadcast_object_list", "reduce", "gather", "scatter", "all_to_all",
               "all_to_all_single", "all_reduce_coalesced", "barrier", "send", "recv", "isend", "irecv",
               "_all_gather_base", "_reduce_scatter_base")
# The installed package's own directory, never a "/trainmon/" substring (a clone may live in a folder named trainmon).
_PACKAGE_DIR = Path(trainmon.__file__).resolve().parent


@functools.cache
def _in_package(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(_PACKAGE_DIR)


class CollectiveCounter:
    """Counts the torch.distributed collectives issued with a trainmon frame on the stack."""

    def __init__(self) -> None:
        self.by_trainmon = 0
        self._originals = {}
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is not None:
                self._originals[name] = original
                setattr(dist, name, self._wrap(original))

    def _wrap(self, original):
        def counted(*args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None:
                if _in_package(frame.f_code.co_filename):
                    self.by_trainmon += 1
                    break
                frame = frame.f_back
            return original(*args, **kwargs)
        return counted

    def take(self) -> int:
        count, self.by_trainmon = self.by_trainmon, 0
        return count


class Block(nn.Module):
    """A pre-norm residual MLP block (a transformer block's MLP half)."""

    def __init__(self, d: int = 8, hidden: int = 20) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class Net(nn.Module):
    """Odd sizes on purpose: uneven shards, and ``head`` (1 output row) has an empty shard on rank 1."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(5, 6, generator=generator), torch.randn(5, 1, generator=generator)


def _full64(tensor: torch.Tensor) -> np.ndarray:
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().double().numpy().copy()


def _hook_keys(model: nn.Module, optimizer: torch.optim.Optimizer) -> list:
    keys = [sorted(getattr(m, attr)) for m in model.modules()
            for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")]
    keys += [sorted(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]
    return keys + [sorted(optimizer._optimizer_step_pre_hooks), sorted(optimizer._optimizer_step_post_hooks)]


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_case(out: Path, case: str, counter: CollectiveCounter) -> None:
    rank = dist.get_rank()
    if case.startswith("fsdp"):
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    else:
        replicas, shards = (int(n) for n in case.split("_")[1].split("x"))
        mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    net = Net()
    reference = copy.deepcopy(net)  # plain, unsharded: each rank's local gradient, independent of FSDP
    # hsdp_1x2 shards the matrices on dim 1 (FSDP's shard_placement_fn), the vectors on dim 0
    placement = (lambda p: Shard(1) if p.ndim == 2 else None) if case == "hsdp_1x2" else None
    for block in net.blocks:
        fully_shard(block, mesh=mesh, shard_placement_fn=placement)
    fully_shard(net, mesh=mesh, shard_placement_fn=placement)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    names = {id(p): name for name, p in net.named_parameters()}
    refs: dict[str, np.ndarray] = {}
    state = {"step": 0}

    def pre_hook(opt, args, kwargs):  # the gradients and parameters the optimizer steps with
        for group in opt.param_groups:
            for p in group["params"]:
                refs[f"{state['step']}|grad_reduced|{names[id(p)]}"] = _full64(p.grad)
                refs[f"{state['step']}|param|{names[id(p)]}"] = _full64(p)

    def post_hook(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                s = opt.state[p]
                for key in ("exp_avg", "exp_avg_sq"):
                    refs[f"{state['step']}|{key}|{names[id(p)]}"] = _full64(s[key])
                refs[f"{state['step']}|step|{names[id(p)]}"] = np.array(float(s["step"]))
                refs[f"{state['step']}|param_after|{names[id(p)]}"] = _full64(p)

    handles = [optimizer.register_step_pre_hook(pre_hook), optimizer.register_step_post_hook(post_hook)]
    unsharded: list[torch.Tensor] = []  # FSDP's unsharded parameters, seen by the test's own hooks during forward

    def see_unsharded(module, args):
        unsharded.extend(p for p in module.parameters(recurse=False)
                         if not hasattr(p, "to_local") and all(p is not q for q in unsharded))

    handles += [m.register_forward_pre_hook(see_unsharded) for m in net.modules()
                if any(True for _ in m.parameters(recurse=False))]
    x, _ = data(0)
    if case == "fsdp":  # one pass before attach (FSDP creates its unsharded parameters); the HSDP cases have none
        net(x).sum().backward()
        optimizer.zero_grad()
    elif case == "fsdp_nosync":  # an evaluation forward before attach: FSDP leaves the root's parameters unsharded
        with torch.no_grad():
            net(x)
        assert not all(hasattr(p, "to_local") for p in net.parameters())
    monitor = TrainerMonitor({
        "output_dir": str(out), "run_name": case, "sinks": ["csv"], "step_interval": INTERVAL,
        "activations": {"enabled": True, "metrics": ["norm", "max"]},
        "weight_grads": {"metrics": METRICS}, "params": {"enabled": True, "metrics": METRICS},
        "optimizer_states": {"states": STATES, "metrics": METRICS, "precursors": True},
        "anomaly": {"actions": ["jsonl"]},
        "ranks": [1] if case == "fsdp_nosync" else None})
    before = _hook_keys(net, optimizer)
    monitor.attach(net, optimizer, grad_acc_steps=MICRO)
    counter.take()
    collectives: list[int] = []
    for step in range(STEPS):
        state["step"] = step
        reference.load_state_dict({name: p.full_tensor() for name, p in net.named_parameters()})
        for micro in range(MICRO):
            x, y = data(1000 * rank + 10 * step + micro)  # different data on each rank
            reference.zero_grad()
            nn.functional.mse_loss(reference(x), y).div(MICRO).backward()
            for name, p in reference.named_parameters():
                key = f"{step}|local|{name}"
                refs[key] = refs.get(key, 0.0) + p.grad.double().numpy()
                if micro == MICRO - 1:
                    refs[f"{step}|local_last|{name}"] = p.grad.double().numpy().copy()
            if case == "fsdp_nosync":  # FSDP's no_sync: reduce-scatter only after the last micro-step
                net.set_requires_gradient_sync(micro == MICRO - 1)
            nn.functional.mse_loss(net(x), y).div(MICRO).backward()
        pre_clip = {name: _full64(p.grad) for name, p in net.named_parameters()}
        refs[f"{step}|grad_norm|"] = np.array(np.sqrt(sum(np.sum(g * g) for g in pre_clip.values())))
        nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        monitor.step()
        collectives.append(counter.take())
    monitor.close()
    monitor.close()  # idempotent
    left = _hook_keys(net, optimizer) != before or any(p._post_accumulate_grad_hooks for p in unsharded)
    for handle in handles:
        handle.remove()
    case_dir = out / case
    case_dir.mkdir(parents=True, exist_ok=True)
    np.savez(case_dir / f"ref_rank{rank}.npz", **refs)
    betas, eps = optimizer.param_groups[0]["betas"], optimizer.param_groups[0]["eps"]
    (case_dir / f"extra_rank{rank}.json").write_text(json.dumps({
        "collectives": collectives, "hooks_left": left, "unsharded_seen": len(unsharded),
        "betas": list(betas), "eps": eps, "lr": optimizer.param_groups[0]["lr"]}))
    dist.barrier()


def run_unsupported(out: Path) -> None:
    """Layouts that must be refused at attach (a world of one): each error, and that nothing was left."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    errors: dict[str, str] = {}

    def attempt(label: str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        monitor = TrainerMonitor({"output_dir": str(out), "run_name": label, "sinks": ["csv"]})
        hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()]
        try:
            monitor.attach(model, optimizer)
        except Exception as exc:
            errors[label] = f"{type(exc).__name__}: {exc}"
        else:
            errors[label] = "attached"
        finally:
            monitor.close()
        after = [len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()]
        errors[label + ":hooks_left"] = str(after != hooks)
        errors[label + ":run_dir"] = str((out / label).exists())

    # tensor parallelism inside FSDP: a 2-D (dp, tp) mesh
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    tp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    parallelize_module(tp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(tp, mesh=mesh["dp"])
    attempt("tensor_parallel", tp, torch.optim.Adam(tp.parameters()))
    # a parameter FSDP does not manage (the root was not sharded)
    partial = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    fully_shard(partial[0], mesh=init_device_mesh("cpu", (1,)))
    attempt("plain_parameter", partial, torch.optim.Adam(partial.parameters()))
    # FSDP1 (cannot be built on a CPU-only machine: an instance that only has the class, for dispatch)
    fsdp1 = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    nn.Module.__init__(fsdp1)
    attempt("fsdp1", fsdp1, None)
    # the same TP model with activations only: nothing to combine, attaches
    monitor = TrainerMonitor({"output_dir": str(out), "run_name": "activations_only", "sinks": ["csv"],
                              "activations": {"enabled": True}, "weight_grads": {"enabled": False},
                              "optimizer_states": {"enabled": False}})
    monitor.attach(tp)
    tp(torch.randn(2, 8)).sum().backward()
    monitor.step()
    monitor.close()
    errors["activations_only"] = "attached"
    (out / "unsupported.json").write_text(json.dumps(errors, indent=1))


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    warnings = Warnings()
    logging.getLogger("trainmon").addHandler(warnings)
    try:
        if cases == ["unsupported"]:
            run_unsupported(out)
        else:
            counter = CollectiveCounter()
            for case in cases:
                run_case(out, case, counter)
                (out / case / f"warnings_rank{dist.get_rank()}.json").write_text(json.dumps(warnings.messages))
                warnings.messages.clear()
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
