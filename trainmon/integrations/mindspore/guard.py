"""The step guard on a MindSpore optimizer cell (PyNative; ``anomaly.guard``): a poisoned step is not applied.

A MindSpore optimizer is a cell: ``optimizer(grads)`` (your loop, ``nn.TrainOneStepCell``, ``Model.train``) runs its
``construct``, which applies the update and advances everything the optimizer keeps: the moments, ``beta1_power``
and ``beta2_power`` (``nn.Adam``), and ``global_step``, the step a learning-rate schedule (``LearningRateSchedule``,
a dynamic list) reads its position from. No MindSpore optimizer takes a ``found_inf`` flag, so the guard decides on
the host, as ``nn.TrainOneStepWithLossScaleCell`` decides an overflow: ``construct`` is wrapped on the instance (the
class is never patched; undone by :meth:`MindSporeStepGuard.close`); before it runs, the gradients it was handed are
measured and judged by :class:`~trainmon.collect.step_guard.GradientJudge` (the torch guard's rules and history, on
the host's CPU), with one wait for the device per step:

- on the CPU (gradients in float16/32/64), the gradients are host memory: torch views of it, after the first
  ``asnumpy()`` waited for MindSpore's queue, measured as the torch guard measures (one ``_foreach_norm``);
- elsewhere, one ``sqrt(sum(g * g))`` per parameter on the device (tensors of one size and dtype together) and the
  ``[P]`` norms read on the host in **one** transfer.

On a skip ``construct`` is not called: nothing of the optimizer changes, bit for bit as a run that never saw the
batch.

MindSpore compiles an optimizer's ``construct`` (``@jit``) by looking the method up on the instance, so the wrapper
takes itself off the instance while the optimizer's own ``construct`` runs (and compiles) and puts itself back after.

Everything of trainmon's runs under the fail-safe guard as part ``step_guard``: if it raises, the step is applied as
without the guard.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import mindspore as ms
import numpy as np
import torch
from mindspore import Tensor, mint, nn

from trainmon.collect.step_guard import GradientJudge, verdict_scalars
from trainmon.integrations.mindspore.host import HOST_DTYPES, host_view, on_cpu
from trainmon.integrations.mindspore.stats import group_matrix, plan_groups, tensor_meta

if TYPE_CHECKING:
    from trainmon.base.guard import Guard
    from trainmon.collect.step_guard import GuardFactory
    from trainmon.config import GuardConfig

logger = logging.getLogger("trainmon")
PART = "step_guard"
_METHOD = "construct"


def guard_refusal(model: Any, optimizer: Any) -> str | None:
    """Why the step guard cannot guard this MindSpore set-up correctly, or None.

    Refused: graph mode (the optimizer's ``construct`` is compiled into the training graph: no Python runs between
    the gradients and the update), no optimizer or one that is not an ``nn.Optimizer``, THOR (its second-order
    statistics are updated in the network's forward, outside the optimizer's step), and the parallel optimizer
    (``use_parallel``: each rank updates a slice and broadcasts it inside the step).
    """
    if optimizer is None:
        return "the step guard needs the optimizer: attach(network, optimizer)"
    if not isinstance(optimizer, nn.Optimizer):
        return f"the step guard holds back a mindspore.nn.Optimizer, got {type(optimizer).__name__}"
    if ms.get_context("mode") != ms.PYNATIVE_MODE:
        return ("the step guard needs PyNative mode (in graph mode the optimizer step is compiled into the training "
                "graph): mindspore.set_context(mode=mindspore.PYNATIVE_MODE)")
    if "thor" in type(optimizer).__name__.lower() or type(optimizer).__module__.endswith(".thor"):
        return ("THOR updates its second-order statistics in the network's forward, outside the optimizer step: a "
                "skipped step would still change them")
    if getattr(optimizer, "use_parallel", False):
        return "the parallel optimizer (use_parallel) updates a slice per rank and broadcasts it inside the step"
    return None


def loss_scale_refusal(train_network: Any) -> str | None:
    """Why ``Model.train``'s train network conflicts with the step guard, or None: a
    ``nn.TrainOneStepWithLossScaleCell`` with a dynamic loss scale counts a step the guard skipped as a good step of
    its scale window (its ``scale_sense`` would not be the one of a run that never saw the batch)."""
    if isinstance(train_network, nn.TrainOneStepWithLossScaleCell) \
            and getattr(train_network, "loss_scaling_manager", None) is not None:
        return ("a dynamic loss scale (DynamicLossScaleManager, nn.TrainOneStepWithLossScaleCell with an update cell) "
                "counts a step the guard skipped as a good step, so its scale would differ from a run without the "
                "batch; use FixedLossScaleManager or no loss scale")
    return None


def step_guard_factory(optimizer: nn.Optimizer, names: Mapping[int, str]) -> GuardFactory:
    """The :class:`~trainmon.integrations.base.Attachment`'s ``step_guard``: builds the guard on ``optimizer``."""

    def build(settings: GuardConfig, guard: Guard, on_decided: Callable[[torch.Tensor | float], None]
              ) -> MindSporeStepGuard:
        return MindSporeStepGuard(settings, optimizer, names, guard, on_decided)

    return build


class MindSporeStepGuard:
    """Judges the gradients handed to a MindSpore optimizer cell and skips a poisoned step (its ``construct`` is
    not called).

    Args:
        settings: the ``anomaly.guard`` config section.
        optimizer: the ``nn.Optimizer`` cell.
        names: ``id(parameter) -> name`` (a parameter missing here is named by its ``Parameter.name``).
        guard: the monitor's fail-safe guard.
        on_decided: told each decision (1.0: skipped, 0.0: applied); the step is over then.
    """

    PART = PART

    def __init__(self, settings: GuardConfig, optimizer: nn.Optimizer, names: Mapping[int, str], guard: Guard,
                 on_decided: Callable[[torch.Tensor | float], None]) -> None:
        self.optimizer = optimizer
        self.params = list(optimizer.parameters)
        self.names = [names.get(id(p), str(p.name)) for p in self.params]
        """The optimizer's parameters' names, in the order of the verdict's ``param`` index."""
        self.metas = [tensor_meta(p) for p in self.params]  # Parameters: read once here, never in the step
        self.host = on_cpu() and all(dtype in HOST_DTYPES for dtype, _ in self.metas)
        """MindSpore on the CPU: the gradients are host memory, measured there after one wait for the queue."""
        self.guard = guard
        self.on_decided = on_decided
        self.judge = GradientJudge(settings)
        scale = float(getattr(optimizer, "loss_scale", 1.0) or 1.0)
        self.loss_scale = scale if scale != 1.0 else None
        """The optimizer's own ``loss_scale``: the gradients it is handed still carry it (``scale_grad``)."""
        self.verdict: list[float] | None = None
        namespace = optimizer.__dict__
        self._previous = namespace.get(_METHOD)  # an instance ``construct`` set before us (kept, called, restored)

        def construct(owner: nn.Optimizer, *args: Any, **kwargs: Any) -> Any:
            return self.call(args, kwargs)

        self._installed = types.MethodType(construct, optimizer)
        namespace[_METHOD] = self._installed
        self.active = True

    def close(self) -> None:
        """Take the wrapper off the optimizer (idempotent); when something wrapped it again on top, it stays as an
        inert pass-through."""
        self.active = False
        namespace = self.optimizer.__dict__
        if namespace.get(_METHOD) is self._installed:
            if self._previous is None:
                del namespace[_METHOD]
            else:
                namespace[_METHOD] = self._previous

    def take(self) -> dict[str, Any]:
        """This step's verdict as scalars (``step_guard/{name}``), then forgotten; ``{}`` when the optimizer did not
        step (or trainmon's part failed)."""
        verdict, self.verdict = self.verdict, None
        return verdict_scalars(verdict)

    # ------------------------------------------------------------------ the wrapped construct
    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The optimizer cell's ``construct(gradients)``, unless the verdict skips it (then False is returned, as
        nothing was applied)."""
        if self.active and not self.guard.off(PART):
            grads = args[0] if args else kwargs.get("gradients", kwargs.get("grads"))
            skipped = self.guard.run(PART, self._decide, grads)  # None: trainmon failed: applied as without it
            if skipped:
                return False
        return self._inner(args, kwargs)

    def _inner(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The optimizer's own ``construct``, with the wrapper off the instance while it runs: MindSpore's ``@jit``
        parses the method it finds on the instance."""
        namespace = self.optimizer.__dict__
        mine = namespace.get(_METHOD)
        if self._previous is None:
            namespace.pop(_METHOD, None)
        else:
            namespace[_METHOD] = self._previous
        try:
            return self.optimizer.construct(*args, **kwargs)
        finally:
            if mine is not None:
                namespace[_METHOD] = mine

    # ------------------------------------------------------------------ the decision (trainmon's part)
    def _decide(self, grads: Sequence[Any]) -> bool:
        """Judge the gradients; True: skip the step."""
        if not isinstance(grads, (tuple, list)) or len(grads) != len(self.params):
            raise TypeError(f"the step guard expected {len(self.params)} gradients (one per optimizer parameter), "
                            f"got {type(grads).__name__}")
        norms = self.host_norms(grads) if self.host else torch.from_numpy(self.norms(grads))
        verdict = self.judge.judge(norms)
        values: list[float] = verdict.tolist()  # host values: the norms' read above is the step's one transfer
        self.verdict = values
        skipped = values[0] > 0
        self.on_decided(1.0 if skipped else 0.0)
        return skipped

    def host_norms(self, grads: Sequence[Any]) -> torch.Tensor:
        """``[P]`` float32 gradient norms of CPU gradients: torch views of their memory, measured as the torch guard
        measures (one ``_foreach_norm`` per dtype)."""
        self._check_dense(grads)
        views = [host_view(grad) for grad in grads]  # sync: the first waits for the queue (the step's one wait)
        norms = self.judge.norms(views)
        return norms / self.loss_scale if self.loss_scale is not None else norms

    def norms(self, grads: Sequence[Any]) -> np.ndarray[Any, np.dtype[np.float32]]:
        """``[P]`` float32 gradient norms, measured on the device and read on the host at once (the sync)."""
        self._check_dense(grads)
        order: list[int] = []
        pieces: list[Tensor] = []
        for group in plan_groups(self.metas):
            if not group.numel:
                continue
            # a gradient has its parameter's dtype and size (read at attach): no metadata read of a queued tensor
            matrix = group_matrix(grads, group)
            norms = mint.sqrt(mint.sum(mint.mul(matrix, matrix), 1))
            pieces.append(norms if group.working_dtype == ms.float32 else norms.astype(ms.float32))
            order.extend(group.indices)
        result = np.zeros(len(self.params), np.float32)
        if pieces:
            stacked = pieces[0] if len(pieces) == 1 else mint.cat(pieces, 0)
            result[order] = stacked.asnumpy()  # sync: the one host read of the step (construct applies or not)
        if self.loss_scale is not None:
            result = result / np.float32(self.loss_scale)
        return result

    def _check_dense(self, grads: Sequence[Any]) -> None:
        for i, grad in enumerate(grads):
            if not isinstance(grad, Tensor):
                raise TypeError(f"the step guard measures dense gradients; {self.names[i]}'s is "
                                f"{type(grad).__name__}")

