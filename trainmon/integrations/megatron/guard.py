"""The step guard under Megatron-Core (``anomaly.guard``): a poisoned step is skipped as Megatron skips an overflow.

Megatron's optimizers (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer`` and a
``ChainedOptimizer`` of them) step in two parts: ``prepare_grads()`` copies the reduced gradients to the main
parameters (and, with a loss scaler, unscales them and returns whether it found an Inf or a NaN), then
``step_with_ready_grads()`` applies them. ``step()`` returns ``(False, None, None)`` without applying anything when
``prepare_grads()`` returns True: Megatron's own skip, which its training loop counts as a skipped iteration
(``update_successful`` False: no LR-scheduler increment in Megatron-LM).

The guard wraps the optimizer's instance ``prepare_grads``. Before it runs, it judges the reduced gradients where the
model keeps them (``param.main_grad``, Megatron DDP's buffer, after the schedule's ``finalize_model_grads``; under the
distributed optimizer this rank's range of it, the range ``prepare_grads`` copies): per-parameter norms, the squared
norms summed over the ranks that hold pieces of each parameter (the tensor-parallel group for partitioned
parameters, counted on TP rank 0 for replicated ones; the distributed optimizer's data-parallel group), with one
``all_reduce`` on the device, then :class:`~trainmon.collect.step_guard.GradientJudge`. The verdict is read on the
host (one synchronisation per step: ``prepare_grads`` returns a Python bool; Megatron reads its grad norm on the host
in ``clip_grad_norm`` already). On a skip ``prepare_grads`` returns True without preparing anything, so nothing of
the optimizer changes (main parameters, states, step counts) and ``step()`` returns ``update_successful`` False.

:class:`~trainmon.integrations.megatron.rerun.RerunValidation` feeds the same judgement to Megatron's rerun state
machine from inside the forward-backward loop (:meth:`MegatronStepGuard.peek`). :func:`guard_refusal` says at
``attach`` which set-ups the guard cannot hold back exactly; :func:`guard_factory` builds it for an attachment.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainmon.collect.step_guard import GradientJudge, verdict_scalars
from trainmon.collect.step_hooks import StepWrapper, installed_wrapper
from trainmon.errors import UnsupportedSetupError
from trainmon.integrations.megatron.groups import probe_group
from trainmon.integrations.megatron.optimizer import leaf_optimizers, main_params

if TYPE_CHECKING:
    from trainmon.base.guard import Guard
    from trainmon.base.types import MegatronParameter
    from trainmon.collect.step_guard import GuardedSteps, GuardFactory
    from trainmon.config import GuardConfig
    from trainmon.integrations.megatron.collect import GroupLayout, MainParam

PART = "step_guard"


def guard_on(optimizer: Any) -> MegatronStepGuard | None:
    """The step guard attached to ``optimizer`` (a Megatron optimizer), or None."""
    wrapper = installed_wrapper(optimizer, "prepare_grads")
    owner = getattr(wrapper.around, "__self__", None) if wrapper is not None else None
    return owner if isinstance(owner, MegatronStepGuard) else None


class MegatronStepGuard:
    """The step guard on one Megatron optimizer (its instance ``prepare_grads`` wrapped; undone by :meth:`close`).

    Args:
        settings: the ``anomaly.guard`` config section.
        optimizer: the Megatron optimizer the training loop steps (a ``ChainedOptimizer`` or a leaf).
        params: ``(name, model parameter)`` of every parameter the optimizer steps, in the verdict's order.
        mains: model parameter id -> where the optimizer keeps it (its distributed-optimizer range).
        tp_rank: this rank's tensor-parallel rank (a parameter replicated over TP counts on rank 0).
        group: the ranks holding pieces of each parameter (None: whole gradients on every rank).
        guard: the monitor's fail-safe guard.
        on_decided: told each step whether it was skipped (1.0, by the guard) or not.
    """

    PART = PART

    def __init__(self, settings: GuardConfig, optimizer: Any, params: Sequence[tuple[str, MegatronParameter]],
                 mains: dict[int, MainParam], tp_rank: int, group: Any, guard: Guard,
                 on_decided: Callable[[torch.Tensor | float], None]) -> None:
        self.optimizer = optimizer
        self.names = [name for name, _ in params]
        self.params = [param for _, param in params]
        self.mains = mains
        self.group = group
        self.guard = guard
        self.on_decided = on_decided
        self.judge = GradientJudge(settings)
        self.counted = [tp_rank == 0 or bool(getattr(p, "tensor_model_parallel", False)) for p in self.params]
        """Whether this rank's gradient of each parameter counts: a TP-replicated parameter's on TP rank 0 only."""
        self.verdict: list[float] | None = None
        self._wrapper = StepWrapper(optimizer, method="prepare_grads", around=self._prepare).install()

    def close(self) -> None:
        self._wrapper.uninstall()

    def take(self) -> dict[str, Any]:
        """This step's verdict as scalars, then forgotten (``{}`` when the optimizer did not step)."""
        verdict, self.verdict = self.verdict, None
        return verdict_scalars(verdict)

    def gradients(self) -> list[torch.Tensor | None]:
        """This rank's pieces of the reduced gradients, in the verdict's order (None: no piece, or not counted)."""
        grads: list[torch.Tensor | None] = []
        for param, counted in zip(self.params, self.counted):
            main = self.mains.get(id(param))
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            if not counted or main is None or grad is None:
                grads.append(None)
                continue
            if main.piece is not None:  # the distributed optimizer's range of the parameter on this rank
                start, numel = main.piece
                grad = grad.view(-1).narrow(0, start, numel) if numel else None
            grads.append(grad)
        return grads

    def peek(self) -> torch.Tensor:
        """The verdict on the gradients as they are now, on the device, without counting it (the history is not
        changed): what the guard would decide if the optimizer stepped now."""
        return self.judge.judge(self.judge.norms(self.gradients(), self.group), record=False)

    # ------------------------------------------------------------------ Megatron's prepare_grads
    def _prepare(self, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.guard.off(PART):
            return inner(*args, **kwargs)
        skipped = self.guard.run(PART, self._decide)  # None: trainmon failed: the step as without the guard
        if skipped:
            self.guard.run(PART, self.on_decided, 1.0)
            return True  # Megatron's found_inf: step() returns (False, None, None), nothing prepared or applied
        found_inf = inner(*args, **kwargs)
        self.guard.run(PART, self.on_decided, 1.0 if found_inf else 0.0)
        return found_inf

    def _decide(self) -> bool:
        verdict = self.judge.judge(self.judge.norms(self.gradients(), self.group))
        values: list[float] = verdict.tolist()  # sync: the one host read of the step (prepare_grads returns a bool)
        self.verdict = values
        return values[0] > 0


def guard_refusal(model: Any, optimizer: Any) -> str | None:
    """Why the step guard cannot hold back this Megatron-Core set-up's steps exactly, or None when it can.

    Supported: one model chunk (no pipeline parallelism), tensor and data parallelism (also the distributed
    optimizer), fp32 and bf16 without a loss scaler; or a plain torch optimizer over chunks without Megatron's DDP
    (the torch guard then).
    """
    from megatron.core import parallel_state as ps

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if optimizer is None:
        return "the step guard needs the optimizer: pass it to attach(chunks, optimizer)"
    if isinstance(optimizer, torch.optim.Optimizer):
        if any(hasattr(p, "main_grad") for chunk in chunks for p in chunk.parameters()):
            return ("a torch optimizer over Megatron DDP chunks steps param.grad while the gradients live in "
                    "param.main_grad: pass the Megatron optimizer (get_megatron_optimizer)")
        return None
    if len(chunks) > 1 or ps.model_parallel_is_initialized() and (
            ps.get_pipeline_model_parallel_world_size() > 1):
        return "pipeline parallelism is not supported by the step guard yet"
    if ps.model_parallel_is_initialized() and ps.get_expert_model_parallel_world_size() > 1:
        return "expert parallelism is not supported by the step guard yet"
    try:
        main_params(optimizer)
    except TypeError as exc:
        return str(exc)
    for leaf in leaf_optimizers(optimizer):
        if getattr(leaf, "grad_scaler", None) is not None:
            return ("a loss scaler (fp16, or loss_scale set) is not supported: it skips its own steps and counts "
                    "the others; use bf16 or fp32")
        if getattr(getattr(leaf, "ddp_config", None), "use_megatron_fsdp", False):
            return "Megatron FSDP is not supported by the step guard yet"
    return None


def guard_factory(optimizer: Any, params: list[tuple[str, MegatronParameter, int]], mains: dict[int, MainParam],
                  layout: GroupLayout) -> GuardFactory:
    """Builds the step guard on ``optimizer`` (``anomaly.guard``): every parameter it steps, judged from this rank's
    pieces of the reduced gradients (summed over the ranks that hold pieces of a parameter)."""

    def build(settings: GuardConfig, guard: Guard, on_decided: Callable[[torch.Tensor | float], None]
              ) -> GuardedSteps:
        try:
            sharded, group = probe_group(mains, layout, user="anomaly.guard")
        except ValueError as exc:
            raise UnsupportedSetupError(str(exc)) from exc
        held = [(name, param) for name, param, _ in params if id(param) in mains and param.requires_grad]
        return MegatronStepGuard(settings, optimizer, held, mains, layout.tp_rank, group if sharded else None, guard,
                                 on_decided)

    return build
