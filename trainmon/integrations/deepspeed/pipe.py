"""DeepSpeed pipeline parallelism: ``monitor.attach(engine)`` for a ``PipelineEngine``.

A ``PipelineEngine`` (``deepspeed.initialize`` of a ``deepspeed.pipe.PipelineModule``) trains with
``engine.train_batch(data_iter)``: one call runs the pipeline schedule over
``gradient_accumulation_steps`` micro-batches (forward, backward, sends and receives between stages),
reduces the gradients and steps the optimizer. ``forward``, ``backward`` and ``step`` raise. So:

- one **monitor step** is one ``train_batch``; its number follows ``engine.global_steps``;
- **micro-steps** are the micro-batches of the schedule. A forward is counted by the root-module
  pre-hook as everywhere; a backward pass belongs to the micro-batch whose forward made the tensors it
  runs through (the 1F1B schedule interleaves forwards of later micro-batches before earlier
  backwards), so a hook on the root's output tensors, put there by that forward, sets the
  micro-step when the pass reaches them, before any parameter gradient or module backward hook;
- ``grad_reduced``, ``param``, optimizer states, ``update``, ``ratio`` and the engine's scalars come
  from :class:`~trainmon.integrations.deepspeed.DeepSpeedShardCollector`, whose pre/post hooks run
  around ``engine._take_model_step`` (the one method both ``engine.step()`` and the pipeline's
  ``OptimizerStep`` instruction call; wrapped on this instance only): after the schedule's
  ``ReduceGrads``, before DeepSpeed's clipping and the optimizer step;
- ``loss``: the value ``train_batch`` returns (the mean over micro-batches, averaged over the
  data-parallel group, broadcast to every stage), read by a wrapper of ``train_batch`` on the instance;
- ``grad_norm``: DeepSpeed's own (``engine.get_global_grad_norm()``; ZeRO-1 combines it over the
  stages); under ZeRO-0 with a torch optimizer DeepSpeed computes none, so the stages' squared norms
  are summed with one ``all_reduce`` over the model-parallel group at the start of the optimizer step,
  where every stage is at once (a tied weight counts once, on the stage that owns it, as DeepSpeed
  counts it). The monitor step itself ends later (next forward, ``monitor.step()``, ``close()``), where
  the stages are not in step, so nothing is combined across stages there;
- ``pp_stage`` is ``engine.stage_id``; module and parameter names are the stage's own
  (``engine.module.named_parameters()``: ``{layer index}.{name}``, ``tied_modules.{key}.{name}``).

Set-ups this cannot monitor exactly are refused at ``attach`` (:class:`PipelineSetupError`). The
attachment is built by :func:`trainmon.integrations.deepspeed.attach` (with the collectors it shares
with ``engine.step()`` training); this module holds what only the pipeline needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from trainmon.collect.hooks import HookedCollector, HookRegistry
from trainmon.collect.tensor_names import named_tensors
from trainmon.errors import UnsupportedSetupError

if TYPE_CHECKING:
    from trainmon.collect.context import StepContext
    from trainmon.collect.step_hooks import StepHook, StepWrapper
    from trainmon.config import MonitorConfig

_MARKS = "pipe_backward_marks"
_MARK_TENSORS = "pipe_backward_mark_tensors"


class PipelineSetupError(UnsupportedSetupError):
    """A pipeline set-up trainmon cannot monitor exactly (raised at ``attach``)."""


class BackwardMarks(HookedCollector):
    """Sets ``ctx.micro_step`` to the micro-batch of each backward pass, and closes each pass.

    The root's forward hook puts a gradient hook on its output tensors that remembers the forward's
    micro-step; the gradient reaches those tensors first in the pass (before any parameter's
    accumulation hook or module backward hook of the stage). Forwards set the micro-step themselves.

    At the end of each pass the activation rows kept for grouped measurement are measured, and the
    step's record of measured tensors is forgotten: DeepSpeed receives every micro-batch's output
    gradient into the same buffer (``grad_layer``) with a ``recv`` that does not bump the tensor's
    version, so a row of the next pass would otherwise reuse this pass's statistics.
    """

    HOOK_GROUPS = (_MARKS,)
    PART = "step"  # every row's micro-step depends on it

    def __init__(self, ctx: StepContext, root: torch.nn.Module, registry: HookRegistry) -> None:
        super().__init__(ctx, registry)
        self.root = root
        ctx.backward_end.append(self._pass_ended)

    def install_hooks(self) -> None:
        self.registry.add(_MARKS, self.root.register_forward_hook(self.guarded(self._forward)))

    def _forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        ctx = self.ctx
        if not (ctx.collecting and torch.is_grad_enabled() and module.training):
            return
        micro_step = ctx.micro_step

        def mark(grad: torch.Tensor) -> None:
            self.ctx.micro_step = micro_step
            self.ctx.schedule_backward_end()  # once per pass: _pass_ended (and the grouped rows' flush) at its end

        for _, tensor in named_tensors(output, ""):
            if tensor.requires_grad and tensor.grad_fn is not None:  # non-leaf: the hook dies with the graph
                self.registry.add(_MARK_TENSORS, tensor.register_hook(self.guarded(mark)))

    def _pass_ended(self) -> None:
        self.ctx.forget_measured()

    def before_transfer(self) -> None:
        self.registry.remove(_MARK_TENSORS)  # the step's backward passes are over

    def reset(self) -> None:
        self.registry.remove(_MARK_TENSORS)

    def release(self) -> None:
        if self._pass_ended in self.ctx.backward_end:
            self.ctx.backward_end.remove(self._pass_ended)


def refusal(engine: Any, config: MonitorConfig) -> str | None:
    """Why trainmon cannot monitor this pipeline engine exactly, or None."""
    grid = engine.grid
    if grid.get_slice_parallel_world_size() > 1:
        return ("DeepSpeed pipeline parallelism with tensor slicing (a topology with a 'model' axis of "
                f"{grid.get_slice_parallel_world_size()}, Megatron-DeepSpeed 3D parallelism) is not supported: "
                "statistics of sliced parameters would be per slice. Monitor a PP x DP topology, or use "
                "trainmon's Megatron-Core integration for tensor parallelism")
    if config.activations.enabled and engine.module.activation_checkpoint_interval > 0:
        return ("activations with DeepSpeed pipeline activation checkpointing "
                f"(activation_checkpoint_interval={engine.module.activation_checkpoint_interval}) are not supported: "
                "the re-run of each checkpointed segment in the backward would be measured again. Set "
                "activations.enabled: false (weight gradients and optimizer states are unaffected), or "
                "activation_checkpoint_interval: 0")
    if config.grad_probe.enabled:
        return ("grad_probe is not supported with DeepSpeed's PipelineEngine yet; set grad_probe.enabled: false "
                "(weight_grads and optimizer_states are supported)")
    for name in ("train_batch", "_take_model_step"):
        if not callable(getattr(engine, name, None)):
            return (f"this DeepSpeed version's PipelineEngine has no {name}(), where trainmon reads the step "
                    "(tested with DeepSpeed 0.19); pin that version or detach trainmon")
    return None


def loss_reader(ctx: StepContext, batch: StepWrapper) -> StepHook:
    """The post-hook of ``train_batch``: its result is the step's loss (a device tensor, read at the transfer)."""

    def read(engine: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        loss = batch.last_result
        if ctx.collecting and isinstance(loss, torch.Tensor):
            ctx.buffer.add_scalar("loss", loss.detach().float().mean())

    return ctx.guard.wrap("loss", read, bypass=torch.compiler.is_compiling)
