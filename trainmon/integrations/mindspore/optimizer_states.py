"""Where a MindSpore optimizer keeps its states and learning rates, and the Adam arithmetic on them: the update, the
update/param ratio and what the ``precursors`` rows need (used by
:class:`~trainmon.integrations.mindspore.optimizer.MindSporeOptimizerCollector`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import mindspore as ms
from mindspore import Parameter, Tensor, mint
from mindspore import nn as ms_nn

from trainmon.integrations.mindspore.stats import constants

if TYPE_CHECKING:
    from mindspore import nn

__all__ = ["AdamMoments", "Precursors", "learning_rates", "state_tuple", "update_ratio"]

_F32 = ms.float32
_STATE_ATTRS: dict[str, tuple[str, ...]] = {
    "exp_avg": ("moment1", "moments1"),
    "exp_avg_sq": ("moment2", "moments2"),
    "momentum": ("moments",),
}
"""Where MindSpore optimizers keep each state, as ParameterTuples aligned with ``optimizer.parameters``."""


def state_tuple(optimizer: nn.Optimizer, family: str) -> Sequence[Parameter] | None:
    """Where ``optimizer`` keeps the state ``family`` (exp_avg, exp_avg_sq, momentum), one Parameter per entry of
    ``optimizer.parameters``, or None."""
    for attr in _STATE_ATTRS[family]:
        value: Sequence[Parameter] | None = getattr(optimizer, attr, None)
        if value is not None and len(value) == len(optimizer.parameters):
            return value
    return None


def learning_rates(optimizer: nn.Optimizer) -> list[Tensor]:
    """Fixed learning rates (one per group) as device tensors; none for a dynamic schedule."""
    if getattr(optimizer, "dynamic_lr", False):
        return []
    lr = getattr(optimizer, "learning_rate", None)
    if isinstance(lr, Tensor):
        return [lr]
    if getattr(optimizer, "is_group_lr", False) and lr is not None:
        return [value for value in lr if isinstance(value, Tensor)]
    return []


class AdamMoments:
    """How to read the Adam update of an optimizer, or None when it is not Adam-like.

    ``nn.Adam`` (bias-corrected, as torch's Adam): ``m_hat / (sqrt(v_hat) + eps)`` with the bias
    corrections ``1 - beta_power`` read from the optimizer's ``beta1_power``/``beta2_power``
    parameters (``vhat`` replaces ``v`` with ``use_amsgrad``). ``nn.AdamWeightDecay`` applies no
    bias correction, so its update is ``m / (sqrt(v) + eps)``.
    """

    def __init__(self, m: Sequence[Parameter], v: Sequence[Parameter], vhat: Sequence[Parameter] | None,
                 eps: Tensor | float, beta_powers: tuple[Parameter, Parameter] | None) -> None:
        self.m, self.v, self.vhat, self.eps, self.beta_powers = m, v, vhat, eps, beta_powers

    @classmethod
    def of(cls, optimizer: nn.Optimizer) -> AdamMoments | None:
        m, v = state_tuple(optimizer, "exp_avg"), state_tuple(optimizer, "exp_avg_sq")
        eps = getattr(optimizer, "eps", None)
        if m is None or v is None or eps is None:
            return None
        vhat = getattr(optimizer, "vhat", None) if getattr(optimizer, "use_amsgrad", False) else None
        powers = getattr(optimizer, "beta1_power", None), getattr(optimizer, "beta2_power", None)
        return cls(m, v, vhat, eps, (powers[0], powers[1]) if powers[0] is not None and powers[1] is not None else None)

    def corrections(self) -> tuple[Tensor, Tensor] | None:
        """``1 - beta1_power``, ``1 - beta2_power`` now (float32, on the device), or None."""
        if self.beta_powers is None:
            return None
        one = constants.scalar(1.0)
        return (mint.sub(one, self.beta_powers[0].astype(ms.float32)),
                mint.sub(one, self.beta_powers[1].astype(ms.float32)))

    def update(self, m: Tensor, v: Tensor, vhat: Tensor | None, corrections: tuple[Tensor, Tensor] | None) -> Tensor:
        """The update of float32 matrices of moments (rows: parameters)."""
        v = self.v_hat(v, vhat, corrections)
        if corrections is not None:
            m = mint.div(m, corrections[0])
        return mint.div(m, mint.add(mint.sqrt(v), self.eps_tensor()))

    def v_hat(self, v: Tensor, vhat: Tensor | None, corrections: tuple[Tensor, Tensor] | None) -> Tensor:
        """The second moment the update divides by: AMSGrad's max, bias-corrected where the optimizer is."""
        if vhat is not None:
            v = mint.maximum(v, vhat)
        return v if corrections is None else mint.div(v, corrections[1])

    def applied_step(self, m: Tensor, v: Tensor, vhat: Tensor | None, corrections: tuple[Tensor, Tensor] | None,
                     lr: Tensor) -> Tensor:
        """What ``nn.Adam`` subtracted from the weights: ``lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) +
        eps)`` (its ``eps`` is added before the bias correction, unlike the ``update`` family's)."""
        if vhat is not None:
            v = mint.maximum(v, vhat)
        step = mint.div(m, mint.add(mint.sqrt(v), self.eps_tensor()))
        if corrections is not None:
            step = mint.div(mint.mul(step, mint.sqrt(corrections[1])), corrections[0])
        return mint.mul(step, lr)

    def eps_tensor(self) -> Tensor:
        """``eps`` as a 0-d float32 tensor."""
        return self.eps.reshape(()).astype(_F32) if isinstance(self.eps, Tensor) else constants.scalar(float(self.eps))


class Precursors:
    """What the ``precursors`` rows of an Adam-like MindSpore optimizer need beyond the moments: the gradients the
    step took (the optimizer cell's input), its one fixed learning rate (NaN for a schedule or per-group rates: then
    ``update_weight_ratio`` is NaN) and, for ``nn.Adam``, its coupled weight decay per parameter (``nn.Adam`` adds
    ``weight_decay * param`` to the gradient of the parameters its ``decay_filter`` kept; ``AdamWeightDecay``
    decays the weights)."""

    def __init__(self, optimizer: nn.Optimizer, grads: Sequence[Tensor], positions: Sequence[int]) -> None:
        self.grads = [grads[i] for i in positions]
        rates = learning_rates(optimizer)
        self.lr: Tensor | None = rates[0] if len(rates) == 1 and not getattr(optimizer, "is_group_lr", False) \
            else None
        decay = getattr(optimizer, "weight_decay", None)
        flags = getattr(optimizer, "decay_flags", None)
        self.decay: Tensor | None = None
        self.decayed = [False] * len(positions)
        if isinstance(optimizer, ms_nn.Adam) and isinstance(decay, Tensor) and decay.size == 1 \
                and flags is not None and len(flags) == len(optimizer.parameters):
            self.decay = decay.reshape(()).astype(_F32)
            self.decayed = [bool(flags[i]) for i in positions]

    def lr_tensor(self) -> Tensor:
        return self.lr.reshape(()).astype(_F32) if self.lr is not None else constants.scalar(math.nan)


def update_ratio(update: Tensor, param: Tensor) -> Tensor:
    """Elementwise ``update / param`` (float32); 0 where the parameter is exactly 0 (as for torch)."""
    nonzero = mint.ne(param, constants.scalar(0.0))
    safe = mint.where(nonzero, param, constants.scalar(1.0))
    return mint.where(nonzero, mint.div(update, safe), constants.scalar(0.0))
