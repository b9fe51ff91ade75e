"""A torchtitan-style training loop on gloo CPU ranks, monitored by trainmon, and the same loop unmonitored.

``python fsdp2_torchtitan.py OUT CASE [CASE ...]`` on 2 ranks (``tests/launch.py``). Set-up as torchtitan's
``parallelize_llama`` does it: each transformer block wrapped for activation checkpointing
(``checkpoint_wrapper``), compiled in place (``block.compile(fullgraph=True)``), ``fully_shard``ed, then the
root; the optimizer is torchtitan's ``OptimizersContainer`` (``tests/torchtitan_optimizer.py``: torchtitan is
not installed); the step is torchtitan's ``train_step`` (accumulation, ``clip_grad_norm_``, the container's
``step()``, a scheduler). CASE:

- ``titan``: that order (AC, compile, FSDP), float32;
- ``shard_then_compile``: ``fully_shard`` first, then ``block.compile(fullgraph=True)`` (the order a user
  reported breaking), float32, activations on (the compiled blocks' must be left out with a warning);
- ``titan_bf16``: ``titan`` with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``,
  skipped (``skipped`` in ``info_rank{R}.json``) where FSDP2 cannot run it on gloo/CPU;
- ``wrapped_blocks``: ``torch.compile(block, fullgraph=True)`` wrappers, each then ``fully_shard``ed (FSDP
  makes it an ``FSDPOptimizedModule``), activations on;
- ``whole_model``: FSDP2 per block and root, then ``torch.compile(model)`` (a wrapper, given to ``attach``);
- ``compile_after_attach``: FSDP2 per block and root, attached, and the blocks compiled in place
  (``fullgraph``) before step 2, every step collected (trainmon's hooks stay installed), activations on.

The backend is ``aot_eager``: it runs dynamo's tracing (which is what broke: a trainmon hook traced into a
``fullgraph`` region raises) and AOT autograd, without inductor's C++ compilation (~20 s a graph on this
machine's 2 cores). Each case trains a monitored model and an unmonitored one from the same seed and writes
``OUT/<case>/rank{R}/...`` (trainmon), ``refs_rank{R}.npz`` (float64: ``full_tensor()`` of the gradients the
optimizer stepped with, read in the container's own step pre-hook; ``exp_avg``/``exp_avg_sq``/``step`` of
every inner optimizer after the step; the pre-clip norm; each rank's own gradient from a plain eager copy
of the model on its data, float32 cases only) and ``info_rank{R}.json`` (inner learning rates, parameters
bit-identical to the unmonitored run, compilations after the first step, step times, warnings).
"""

from __future__ import annotations

import copy
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from fsdp2_train import Warnings, _full64  # the FSDP2 worker beside this script (its folder is sys.path[0])
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from tests.torchtitan_optimizer import OptimizersContainer
from trainmon import TrainerMonitor

STEPS, MICRO, INTERVAL, MAX_NORM = 4, 2, 2, 1.0
METRICS = ["norm", "min", "max", "mean", "zeros", "nans", "infs"]
PARAM_GROUPS = [  # torchtitan's ParamGroupConfig: first match wins; two optimizer types -> two inner optimizers
    {"pattern": r"norm|bias", "optimizer_name": "Adam", "optimizer_kwargs": {"lr": 1e-2, "betas": (0.9, 0.95)}},
    {"pattern": r".*", "optimizer_name": "AdamW",
     "optimizer_kwargs": {"lr": 2e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}},
]


class Block(nn.Module):
    """A pre-norm residual MLP block (a transformer block's feed-forward half)."""

    def __init__(self, d: int = 16, hidden: int = 40) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(d)
        self.w1 = nn.Linear(d, hidden)
        self.w2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(nn.functional.gelu(self.w1(self.attention_norm(x))))


class Transformer(nn.Module):
    """torchtitan's model layout: ``tok_embeddings``, ``layers`` (a ModuleDict), ``norm``, ``output``."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.tok_embeddings = nn.Linear(6, d)
        self.layers = nn.ModuleDict({str(i): Block(d) for i in range(2)})
        self.norm = nn.LayerNorm(d)
        self.output = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


class CountingBackend:
    """``aot_eager``, counting the graphs dynamo hands it (a recompilation is one more)."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, inputs: list[Any], **kwargs: Any) -> Any:
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs += 1
        return aot_eager(gm, inputs, **kwargs)


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(4, 5, 6, generator=generator), torch.randn(4, 5, 1, generator=generator)


def canonical(name: str) -> str:
    """A parameter's name as trainmon writes it: no level of a compiled wrapper (``_orig_mod``) or of an
    activation-checkpoint wrapper (``_checkpoint_wrapped_module``), i.e. the plain model's name."""
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def build(case: str, backend: CountingBackend) -> tuple[nn.Module, nn.Module, nn.Module]:
    """The parallelised model (torchtitan's ``parallelize_llama``), what the loop calls (a compiled wrapper of it
    for ``whole_model``), and a plain eager copy of its initial weights."""
    torch._dynamo.reset()  # each model compiles from scratch: dynamo's recompile limit (8) counts per code object
    torch.manual_seed(0)
    model = Transformer()
    plain = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if case.endswith("bf16") \
        else MixedPrecisionPolicy()
    for name, block in list(model.layers.named_children()):
        if case == "shard_then_compile":
            fully_shard(block, mesh=mesh, mp_policy=mp)
            block.compile(backend=backend, fullgraph=True)
        elif case == "wrapped_blocks":
            block = torch.compile(block, backend=backend, fullgraph=True)
            fully_shard(block, mesh=mesh, mp_policy=mp)
            model.layers.register_module(name, block)
        elif case in ("whole_model", "compile_after_attach"):
            fully_shard(block, mesh=mesh, mp_policy=mp)
        else:
            block = checkpoint_wrapper(block, preserve_rng_state=False)
            block.compile(backend=backend, fullgraph=True)
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
            model.layers.register_module(name, block)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    runner = torch.compile(model, backend=backend) if case == "whole_model" else model
    return model, runner, plain


def train(case: str, out: Path, monitored: bool, refs: dict[str, np.ndarray], info: dict[str, Any]) -> nn.Module:
    rank = dist.get_rank()
    backend = CountingBackend()
    model, runner, plain = build(case, backend)
    optimizers = OptimizersContainer(PARAM_GROUPS, [model])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizers.optimizers[0], lambda s: 1.0 / (1 + s))
    names = {id(p): canonical(name) for name, p in model.named_parameters()}
    state = {"step": 0}

    def pre_hook(opt, args, kwargs):  # the gradients the inner optimizers step with (after clipping)
        for p in opt.param_groups[0]["params"]:
            refs[f"{state['step']}|grad_reduced|{names[id(p)]}"] = _full64(p.grad)

    def post_hook(opt, args, kwargs):
        for i, inner in enumerate(opt.optimizers):
            for g, group in enumerate(inner.param_groups):
                info.setdefault("lr", {})[f"{state['step']}|{i}|{g}"] = float(group["lr"])
                for p in group["params"]:
                    for key in ("exp_avg", "exp_avg_sq"):
                        refs[f"{state['step']}|{key}|{names[id(p)]}"] = _full64(inner.state[p][key])

    handles = [optimizers.register_step_pre_hook(pre_hook), optimizers.register_step_post_hook(post_hook)] \
        if monitored else []
    monitor = None
    if monitored:
        monitor = TrainerMonitor({
            "output_dir": str(out), "run_name": case, "sinks": ["csv"],
            "step_interval": 1 if case == "compile_after_attach" else INTERVAL,
            "activations": {"enabled": case in ("shard_then_compile", "wrapped_blocks", "compile_after_attach"),
                            "metrics": ["norm", "max"]},
            "weight_grads": {"metrics": METRICS}, "optimizer_states": {"metrics": METRICS},
            "anomaly": {"actions": ["jsonl"]}})
        monitor.attach(runner, optimizers, grad_acc_steps=MICRO)
    times, graphs_after_first = [], 0
    local = monitored and not case.endswith("bf16")  # each rank's own gradient, from a plain eager copy
    info["inner_params"] = [[n for g in inner.param_groups for n in g["param_names"]] for inner in optimizers]
    for step in range(STEPS):
        state["step"] = step
        if case == "compile_after_attach" and step == 2:
            for block in model.layers.values():
                block.compile(backend=backend, fullgraph=True)
        started = time.perf_counter()
        graphs_before = backend.graphs
        if local:
            plain.load_state_dict({canonical(name): p.full_tensor()
                                   for name, p in model.named_parameters()})
        optimizers.zero_grad()
        for micro in range(MICRO):  # torchtitan's train_step: gradient accumulation, loss scaled per micro-batch
            x, y = data(1000 * rank + 10 * step + micro)
            loss = nn.functional.mse_loss(runner(x).float(), y) / MICRO
            loss.backward()
            if local and micro == MICRO - 1:  # FSDP reduces every micro-step: the last one's own gradient
                plain.zero_grad()
                (nn.functional.mse_loss(plain(x), y) / MICRO).backward()
                for name, p in plain.named_parameters():
                    refs[f"{step}|local|{name}"] = p.grad.double().numpy().copy()
        if monitored:
            refs[f"{step}|grad_norm|"] = np.array(np.sqrt(sum(np.sum(_full64(p.grad) ** 2)
                                                              for p in model.parameters())))
        nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)
        optimizers.step()
        scheduler.step()
        if monitor is not None:
            monitor.step(loss=loss)
        times.append(time.perf_counter() - started)
        if step > (2 if case == "compile_after_attach" else 0):
            graphs_after_first += backend.graphs - graphs_before
    if monitor is not None:
        monitor.close()
    for handle in handles:
        handle.remove()
    info["monitored" if monitored else "unmonitored"] = {"times": times, "graphs_after_first": graphs_after_first,
                                                         "graphs": backend.graphs}
    return model


def run_case(out: Path, case: str, warnings: Warnings) -> None:
    rank = dist.get_rank()
    case_dir = out / case
    case_dir.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {}
    refs: dict[str, np.ndarray] = {}
    if case.endswith("bf16"):
        try:
            train(case, out / "_probe", monitored=False, refs={}, info={})
        except Exception as exc:  # a capability probe: FSDP2's bf16 all-gather/reduce-scatter on gloo/CPU
            info["skipped"] = f"FSDP2 with MixedPrecisionPolicy(bfloat16) does not run on gloo/CPU: {exc!r}"[:500]
            (case_dir / f"info_rank{rank}.json").write_text(json.dumps(info))
            dist.barrier()
            return
    plain_run = train(case, out, monitored=False, refs={}, info=info)
    warnings.messages.clear()
    monitored_run = train(case, out, monitored=True, refs=refs, info=info)
    info["warnings"] = list(warnings.messages)
    info["bit_identical"] = all(torch.equal(a.full_tensor(), b.full_tensor())
                                for a, b in zip(plain_run.parameters(), monitored_run.parameters()))
    info["names"] = [canonical(name) for name, _ in monitored_run.named_parameters()]
    np.savez(case_dir / f"refs_rank{rank}.npz", **refs)
    (case_dir / f"info_rank{rank}.json").write_text(json.dumps(info))
    dist.barrier()


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    warnings = Warnings()
    logging.getLogger("trainmon").addHandler(warnings)
    try:
        for case in cases:
            run_case(out, case, warnings)
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
