"""The step guard under DeepSpeed (``anomaly.guard``): a poisoned step is skipped by DeepSpeed's own overflow path.

DeepSpeed 0.19's optimizer wrappers already skip a step whose global gradient norm is not finite: ZeRO 1/2
(``DeepSpeedZeroOptimizer.step``: ``scaled_global_norm()``, then ``is_invalid_grad_norm``), ZeRO-3
(``_get_norm_groups()``), the BF16 optimizer (``get_grads_for_norm()``) and the unfused fp16/bf16 wrapper of
ZeRO-0 (``overflow_checker.check()``). On that path DeepSpeed sets ``optimizer.overflow``, clears the gradients and
leaves the fp32 master weights and the optimizer states untouched; the engine then counts ``skipped_steps``, does
not step its LR scheduler, and ``engine.was_step_applied()`` is False.

The guard judges the gradients when the engine's optimizer step begins (``engine._take_model_step``, wrapped on
the instance): reduced over the data-parallel group, before any clipping (ZeRO-0 fp32 clips in that method, the
wrappers inside their step). Each parameter's norm comes from this rank's shard of the reduced gradient
(``ShardLayout.grad``), the squared norms summed over the data-parallel group with one ``all_reduce`` on the device
(ZeRO 1-3; ZeRO-0 holds whole gradients), then :class:`~trainmon.collect.step_guard.GradientJudge` decides. The
verdict enters DeepSpeed's decision through the one value that decision reads: the norm DeepSpeed computes is
returned as NaN when the verdict says skip, and bit for bit as computed otherwise (ZeRO-0 bf16's unfused wrapper:
its overflow check says True). Nothing of the gradients, weights or states is touched. No host synchronisation is
added: DeepSpeed reads its norm on the host already and the verdict stays a device tensor until then (the unfused
wrapper's check reads it right after DeepSpeed's own read, when the device is past it).

ZeRO-0 in fp32 has no wrapper: the engine steps the torch optimizer, and DeepSpeed applies any gradient. There the
verdict is read on the host (one synchronisation per step), a skipped step does not call the optimizer's ``step``,
and the guard tells the engine through the attribute DeepSpeed's wrappers use, ``optimizer.overflow`` (set for that
step only), so that the engine handles it as its own skip.

:func:`guard_refusal` says at ``attach`` which set-ups the guard cannot hold back exactly; :func:`guard_factory`
builds it for an attachment.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainmon.collect.step_guard import GradientJudge, verdict_scalars
from trainmon.collect.step_hooks import StepWrapper
from trainmon.integrations.deepspeed.groups import partition_group
from trainmon.integrations.deepspeed.shards import layout_for

if TYPE_CHECKING:
    from trainmon.base.guard import Guard
    from trainmon.base.types import DeepSpeedParameter
    from trainmon.collect.step_guard import GuardedSteps, GuardFactory
    from trainmon.config import GuardConfig
    from trainmon.integrations.base import AttachOptions
    from trainmon.integrations.deepspeed.collect import DeepSpeedShardCollector
    from trainmon.integrations.deepspeed.shards import ShardLayout

PART = "step_guard"


def optimizer_kind(optimizer: Any) -> str | None:
    """Which of DeepSpeed's optimizers ``optimizer`` is, by exact type (a subclass may step otherwise): ``zero``
    (ZeRO 1/2), ``zero3``, ``bf16``, ``unfused`` (ZeRO-0 fp16/bf16), ``torch`` (a torch optimizer: ZeRO-0 fp32),
    or None."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    kinds: dict[type, str] = {DeepSpeedZeroOptimizer: "zero", DeepSpeedZeroOptimizer_Stage3: "zero3",
                              BF16_Optimizer: "bf16", FP16_UnfusedOptimizer: "unfused"}
    if type(optimizer) in kinds:
        return kinds[type(optimizer)]
    return "torch" if isinstance(optimizer, torch.optim.Optimizer) else None


class DeepSpeedStepGuard:
    """The step guard on one ``DeepSpeedEngine`` (instance methods wrapped; undone by :meth:`close`).

    The verdict is made when the engine's optimizer step begins (``engine._take_model_step``, on an accumulation
    boundary, after the gradient reduction and before ZeRO-0's gradient clipping), and read by DeepSpeed's overflow
    decision inside ``engine.optimizer.step()``.

    Args:
        settings: the ``anomaly.guard`` config section.
        engine: the engine (checked by :func:`~trainmon.integrations.deepspeed.guard_refusal` first).
        layout: where each parameter's shard of the reduced gradient lives on this rank.
        params: ``(name, parameter)`` of every trainable parameter of ``engine.module``, in the verdict's order.
        guard: the monitor's fail-safe guard.
        on_decided: told after each optimizer step whether DeepSpeed skipped it (1.0) or applied it (0.0).
        reduce_group: the group the gradient shards are spread over (None: whole gradients on every rank).
        norm_sink: given the global norm the guard judged, on a step DeepSpeed skipped (DeepSpeed then reports an
            infinite norm): the norm trainmon records as ``grad_norm``.
    """

    PART = PART

    def __init__(self, settings: GuardConfig, engine: Any, layout: ShardLayout,
                 params: Sequence[tuple[str, DeepSpeedParameter]], guard: Guard,
                 on_decided: Callable[[torch.Tensor | float], None], reduce_group: Any = None,
                 norm_sink: Callable[[torch.Tensor | float], None] | None = None) -> None:
        self.engine = engine
        self.optimizer = engine.optimizer
        self.layout = layout
        self.names = [name for name, _ in params]
        self.params = [param for _, param in params]
        self.guard = guard
        self.on_decided = on_decided
        self.reduce_group = reduce_group
        self.norm_sink = norm_sink
        self.judge = GradientJudge(settings)
        self.kind = optimizer_kind(self.optimizer)
        self.verdict: torch.Tensor | list[float] | None = None
        """This step's :data:`~trainmon.base.records.GUARD_VERDICT` (on the device, or read on the host)."""
        self.skip: torch.Tensor | None = None
        """While the engine's optimizer step runs: the verdict's skip flag (DeepSpeed's overflow decision reads it)."""
        self.host_skip = False
        """ZeRO-0 fp32, while the engine's optimizer step runs: the verdict read on the host says skip."""
        self._wrappers: list[StepWrapper] = []
        try:
            self._wrappers.append(StepWrapper(engine, method="_take_model_step", around=self._model_step).install())
            marks: dict[str | None, tuple[Any, str, Callable[..., Any]]] = {
                "torch": (self.optimizer, "step", self._torch_step),
                "zero": (self.optimizer, "scaled_global_norm", self._nan_norm),
                "zero3": (self.optimizer, "_get_norm_groups", self._nan_first_norm),
                "bf16": (self.optimizer, "get_grads_for_norm", self._nan_grads_for_norm),
                "unfused": (getattr(self.optimizer, "overflow_checker", None), "check", self._overflow),
            }
            owner, method, around = marks[self.kind]
            self._wrappers.append(StepWrapper(owner, method=method, around=around).install())
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        while self._wrappers:
            self._wrappers.pop().uninstall()

    def take(self) -> dict[str, Any]:
        """This step's verdict as scalars, then forgotten (``{}`` when the optimizer did not step)."""
        verdict, self.verdict = self.verdict, None
        return verdict_scalars(verdict)

    # ------------------------------------------------------------------ the engine's optimizer step
    def _model_step(self, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.guard.off(PART):
            self.skip = self.guard.run(PART, self._decide)
        try:
            return inner(*args, **kwargs)  # DeepSpeed's: its overflow decision reads self.skip
        finally:
            self.skip, self.host_skip = None, False
            if self.kind == "torch":
                self.optimizer.__dict__.pop("overflow", None)  # read by the engine already
            self.guard.run(PART, self._after)

    def _decide(self) -> torch.Tensor:
        """This step's verdict on the device (kept in :attr:`verdict`); returns its skip flag (ZeRO-0 fp32: the
        verdict read on the host, the one synchronisation of that set-up's step)."""
        grads = [self.layout.grad(param) for param in self.params]
        norms = self.judge.norms(grads, self.reduce_group)  # every rank joins the reduction, holding a piece or not
        verdict = self.judge.judge(norms)
        self.verdict = verdict
        if self.kind == "torch":
            values: list[float] = verdict.tolist()  # sync: the torch optimizer's skip is decided on the host
            self.verdict = values
            self.host_skip = values[0] > 0
        return verdict[0]

    def _after(self) -> None:
        """DeepSpeed decided: the step model is told (the engine's own host flag, no read of the device)."""
        skipped = not self.engine.was_step_applied()
        self.on_decided(1.0 if skipped else 0.0)
        verdict = self.verdict
        if skipped and verdict is not None and self.norm_sink is not None:
            self.norm_sink(verdict[6])  # GUARD_VERDICT's grad_norm: the norm DeepSpeed did not report

    def _torch_step(self, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """ZeRO-0 fp32's torch optimizer: a skip does not call its ``step`` and says ``overflow`` to the engine,
        which reads it right after, as it reads its wrappers' (removed again when the engine's step ends)."""
        if not self.host_skip:
            return inner(*args, **kwargs)
        self.optimizer.__dict__["overflow"] = True
        return None

    # ------------------------------------------------------------------ the verdict into DeepSpeed's decision
    def _marked(self, value: torch.Tensor | float) -> torch.Tensor | float:
        """``value`` (a norm) as NaN when the verdict says skip, else bit for bit as it is (on the device)."""
        skip = self.skip
        if skip is None:
            return value
        norm = value if isinstance(value, torch.Tensor) else torch.tensor(float(value), device=skip.device)
        return torch.where(skip.to(norm.device) > 0, math.nan, norm)

    def _marking(self, mark: Callable[[Any], Any], result: Any) -> Any:
        """``mark(result)`` under the fail-safe guard; ``result`` unchanged when trainmon's part fails."""
        if self.skip is None:
            return result
        marked = self.guard.run(PART, mark, result)
        return result if marked is None else marked

    def _nan_norm(self, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """ZeRO 1/2: ``scaled_global_norm()``, the norm ``step()`` checks with ``is_invalid_grad_norm``."""
        return self._marking(self._marked, inner(*args, **kwargs))

    def _nan_first_norm(self, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """ZeRO-3: ``_get_norm_groups()``, the group norms ``step()`` combines and checks."""
        return self._marking(lambda groups: [self._marked(groups[0]), *groups[1:]] if groups else groups,
                             inner(*args, **kwargs))

    def _nan_grads_for_norm(self, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """BF16 optimizer: ``get_grads_for_norm()``, whose global norm ``step()`` checks. The smallest tensor is
        replaced by a copy that is NaN on a skip (equal values otherwise: the same norm); never for clipping."""
        result = inner(*args, **kwargs)
        if kwargs.get("for_clipping", args[0] if args else False):
            return result
        return self._marking(self._nan_tensor, result)

    def _nan_tensor(self, result: tuple[list[torch.Tensor], Any]) -> tuple[list[torch.Tensor], Any]:
        tensors, experts = result
        skip = self.skip
        assert skip is not None  # _marking checked
        if not tensors:
            return [torch.where(skip > 0, math.nan, skip.new_zeros(1))], experts
        smallest = min(range(len(tensors)), key=lambda i: tensors[i].numel())
        marked = list(tensors)
        marked[smallest] = torch.where(skip.to(tensors[smallest].device) > 0, math.nan, tensors[smallest])
        return marked, experts

    def _overflow(self, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """ZeRO-0 bf16 (the unfused wrapper): ``overflow_checker.check()``, a host bool after DeepSpeed's own read;
        the verdict is read then too (the device is past it already)."""
        overflow = inner(*args, **kwargs)
        skip = self.skip
        if overflow or skip is None:
            return overflow
        return bool(self.guard.run(PART, lambda: skip.item() > 0))  # sync: after DeepSpeed's own in check()


def guard_refusal(engine: Any) -> str | None:
    """Why the step guard cannot hold back this engine's steps exactly, or None when it can.

    Supported: ``DeepSpeedEngine`` (not the pipeline engine) in fp32 or bf16 under ZeRO 0-3 without offload, with
    DeepSpeed's ZeRO 1/2, ZeRO-3, BF16 or unfused ZeRO-0 bf16 optimizer, or a torch optimizer under ZeRO-0 fp32.
    """
    from deepspeed import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if not isinstance(engine, DeepSpeedEngine):
        return None  # attach() says what it needs
    if isinstance(engine, PipelineEngine):
        return "DeepSpeed's PipelineEngine (train_batch) is not supported by the step guard yet"
    if engine.fp16_enabled():
        return ("fp16 is not supported: DeepSpeed's overflow skip also lowers its dynamic loss scale, so a step the "
                "guard skips would change the run's later loss scales (use bf16)")
    if getattr(engine, "torch_autocast_z0_gradscaler", None) is not None:
        return "torch autocast with DeepSpeed's GradScaler is not supported (a GradScaler skips its own steps)"
    optimizer = engine.optimizer
    if optimizer is None:
        return "the engine has no optimizer"
    kind = optimizer_kind(optimizer)
    if kind is None:
        return (f"DeepSpeed's optimizer wrapper {type(optimizer).__name__} is not supported (supported: ZeRO 1/2 and "
                "3, the BF16 optimizer, ZeRO-0 bf16's unfused wrapper, a torch optimizer under ZeRO-0 fp32)")
    if kind == "zero" and optimizer.cpu_offload or kind == "zero3" and (
            optimizer.offload_optimizer or getattr(optimizer, "offload_param", False)):
        return "ZeRO-Offload is not supported (DeepSpeed checks offloaded gradients for overflow during backward)"
    if kind == "zero" and not optimizer.compute_grad_norm:
        return "zero_optimization.compute_grad_norm: false is not supported (DeepSpeed then checks no norm)"
    if kind == "zero" and optimizer.dtype == torch.bfloat16 and not optimizer.check_grad_overflow:
        return ("bf16.check_grad_overflow: false is not supported: DeepSpeed then applies a step whatever its norm, "
                "so it has no skip to take")
    return None


def guard_factory(engine: Any, params: list[tuple[str, DeepSpeedParameter, int]], options: AttachOptions,
                  collector: DeepSpeedShardCollector | None) -> GuardFactory:
    """Builds the step guard on ``engine`` (``anomaly.guard``): every trainable parameter, judged from this rank's
    shards of the reduced gradients (summed over the group they are spread over)."""

    def build(settings: GuardConfig, guard: Guard, on_decided: Callable[[torch.Tensor | float], None]
              ) -> GuardedSteps:
        trainable = [item for item in params if item[1].requires_grad]
        layout = layout_for(engine, [param for _, param, _ in trainable])
        group = None if layout.replicated else partition_group(engine, trainable, options)
        return DeepSpeedStepGuard(settings, engine, layout, [(name, param) for name, param, _ in trainable], guard,
                                  on_decided, group, None if collector is None else collector.record_guard_norm)

    return build
