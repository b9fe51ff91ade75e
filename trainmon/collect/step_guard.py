"""The step guard (torch): a step whose gradients are poisoned is not applied (``anomaly.guard``).

At every ``optimizer.step()`` (the instance's ``step`` is wrapped, as :class:`~trainmon.collect.step_hooks.StepWrapper`
does), before the optimizer runs, the guard measures the gradient norm of every optimizer parameter (one
``_foreach_norm`` per device and dtype, stacked on the device; under FSDP2 the shards' squared norms are summed over
the shard group with one ``all_reduce``, on the device) and judges them on the device: non-finite values, the
global norm above ``max_grad_norm``, or a z-score above ``z_threshold`` against the norms of the last ``window``
applied steps (running statistics kept on the device). Then:

- **device flag** (torch's own ``Adam``, ``AdamW`` and ``SGD`` with ``fused=True``): the verdict is handed to the
  fused kernel as ``optimizer.found_inf``, as a ``GradScaler`` does: on 1 the kernel leaves the parameters and
  moments as they are and the step counters are put back. No host synchronisation is added. (An ``SGD`` with
  momentum decides on the host until its momentum buffers exist: its fused kernel would leave a new buffer
  uninitialised.)
- **host decision** (every other optimizer): the verdict is read on the host (one synchronisation per step) and
  a skipped step does not call the optimizer's ``step`` at all (its step hooks do not run).

The judgement itself (norms, rules, the history on the device) is :class:`GradientJudge`, shared with the DeepSpeed
and Megatron-Core guards (``trainmon.integrations.{deepspeed,megatron}.guard``), which skip through their framework's
own overflow path instead of this wrapper.

A ``closure`` (LBFGS, Lightning) is called first, as the optimizer would, so that the gradients exist; the optimizer
gets a closure that returns that first result, then calls the user's again. Everything of trainmon's runs under
the fail-safe guard as part ``step_guard``: if it raises, the step is applied as without the guard.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from trainmon.base.records import GUARD_PREFIX, GUARD_VERDICT
from trainmon.collect.optimizer_parts import optimizer_parts, param_groups_of
from trainmon.collect.stats_base import foreach_norms, norm_of_norms
from trainmon.collect.step_hooks import StepWrapper, state_dict_init_step

if TYPE_CHECKING:
    from trainmon.base.guard import Guard
    from trainmon.config import GuardConfig

logger = logging.getLogger("trainmon")
PART = "step_guard"
_APPLY, _SKIP = "apply", "skip"
_MIN_RELATIVE_STD = 0.01
"""The standard deviation counts as at least this fraction of the mean: a constant history would make any rise an
outlier."""
_FUSED_TYPES: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def takes_device_flag(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is torch's own Adam, AdamW or SGD with ``fused=True`` in every group, whose kernels
    skip the update on a device flag ``found_inf`` (subclasses may step otherwise and are not trusted).

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> takes_device_flag(torch.optim.AdamW(layer.parameters(), fused=True))
        True
        >>> takes_device_flag(torch.optim.AdamW(layer.parameters(), foreach=True))
        False
    """
    return type(optimizer) in _FUSED_TYPES and all(group.get("fused") for group in optimizer.param_groups)


class GuardedSteps(Protocol):
    """What the monitor's session needs of a step guard: this one (torch) or an integration's (DeepSpeed's,
    Megatron-Core's), which judge with :class:`GradientJudge` and skip through their framework's own path."""

    @property
    def names(self) -> Sequence[str]:
        """The parameters' names, in the order of the verdict's ``param`` index."""

    def take(self) -> dict[str, Any]:
        """This step's verdict as scalars (:func:`verdict_scalars`), then forgotten."""

    def close(self) -> None:
        """Undo every wrapper (idempotent)."""


GuardFactory = Callable[["GuardConfig", "Guard", Callable[[torch.Tensor | float], None]], GuardedSteps]
"""How an integration builds its step guard: ``(settings, fail-safe guard, on_decided) -> guard``."""


def verdict_scalars(verdict: torch.Tensor | Sequence[float] | None) -> dict[str, Any]:
    """A step's :data:`~trainmon.base.records.GUARD_VERDICT` as the scalars ``step_guard/{name}`` (the skip flag
    goes as ``step_skipped`` through the step model); ``{}`` without a verdict.

    Example:
        >>> sorted(verdict_scalars([1.0, 2.0, 0.0, 5.0, 1.0, 4.0, 5.0, 1.0, 4.0]))[:3]
        ['step_guard/baseline', 'step_guard/grad_norm', 'step_guard/grad_norm_mean']
    """
    if verdict is None:
        return {}
    return {GUARD_PREFIX + name: verdict[i] for i, name in enumerate(GUARD_VERDICT) if i}


class GradientJudge:
    """The step guard's judgement on the device, shared by every set-up (torch, FSDP2, DeepSpeed, Megatron-Core):
    gradient norms in, the :data:`~trainmon.base.records.GUARD_VERDICT` vector out, with the history of the applied
    steps' norms (``window x (1 + parameters)`` floats on the device).

    Args:
        settings: the ``anomaly.guard`` config section.

    Example:
        >>> from trainmon.config import GuardConfig
        >>> judge = GradientJudge(GuardConfig(enabled=True, max_grad_norm=5.0))
        >>> norms = judge.norms([torch.full((2,), 3.0), None, torch.full((1,), 4.0)])
        >>> norms.tolist()
        [4.242640495300293, 0.0, 4.0]
        >>> verdict = judge.judge(norms)
        >>> verdict[0].item(), verdict[1].item(), verdict[2].item()  # skipped, reason (max_grad_norm), parameter
        (1.0, 2.0, 0.0)
    """

    def __init__(self, settings: GuardConfig) -> None:
        self.settings = settings
        self.decisions = 0
        """Steps judged with ``record`` (each writes a row of the history)."""
        self._history: torch.Tensor | None = None  # [window, 1 + P] norms: the global one, then each parameter's
        self._applied: torch.Tensor | None = None  # [window] bool: the row is an applied step's
        self._zero: torch.Tensor | None = None

    def reset(self) -> None:
        """The parameters changed: the history starts again."""
        self._history = self._applied = None

    def norms(self, grads: Sequence[torch.Tensor | None], reduce_group: Any = None,
              scale: torch.Tensor | None = None) -> torch.Tensor:
        """``[P]`` float32 gradient norms in the order of ``grads`` (0 for None; ``P > 0``), on the first gradient's
        device (the CPU when there is none).

        Args:
            grads: this rank's gradients (a DTensor's local shard is taken).
            reduce_group: the process group whose ranks hold pieces of each gradient: their squared norms are
                summed over it with one ``all_reduce`` on the device (every rank must pass the same ``P``).
            scale: the loss scale the gradients still carry (a device tensor): the norms are divided by it.
        """
        local = [None if grad is None else _local(grad) for grad in grads]
        device = next((grad.device for grad in local if grad is not None), torch.device("cpu"))
        if self._zero is None or self._zero.device != device:
            self._zero = torch.zeros((), dtype=torch.float32, device=device)
        per_param: list[torch.Tensor] = [self._zero] * len(local)
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, grad in enumerate(local):
            if grad is not None:
                groups.setdefault((grad.device, grad.dtype), []).append(i)
        for indices in groups.values():
            norms = foreach_norms([local[i] for i in indices])  # type: ignore[misc]
            for i, norm in zip(indices, norms):
                per_param[i] = norm.to(device=device, dtype=torch.float32)
        stacked = torch.stack(per_param)
        if reduce_group is not None:
            import torch.distributed as dist

            squares = stacked.double().square()
            dist.all_reduce(squares, group=reduce_group)  # the shards' sums of squares, on the device
            stacked = squares.sqrt().float()
        return stacked / scale.to(device, torch.float32) if scale is not None else stacked

    def judge(self, norms: torch.Tensor, *, scaler_skips_nonfinite: bool = False, record: bool = True
              ) -> torch.Tensor:
        """The :data:`GUARD_VERDICT` vector of this step (on the device); with ``record`` the history is updated
        with it (``record=False``: a look that changes nothing, as Megatron's rerun validation takes).

        Args:
            norms: ``[P]`` per-parameter gradient norms (:meth:`norms`), ``P > 0``.
            scaler_skips_nonfinite: a loss scaler skips non-finite steps itself: the ``nonfinite`` rule is off.
            record: count the step and write its norms into the history.
        """
        settings = self.settings
        total = norm_of_norms(norms)
        series = torch.cat([total.view(1), norms])  # [1 + P]: the global norm, then each parameter's
        if self._history is None or self._applied is None or self._history.shape[1] != series.numel():
            self._history = series.new_zeros((settings.window, series.numel()))
            self._applied = torch.zeros(settings.window, dtype=torch.bool, device=series.device)
        history, applied = self._history, self._applied
        count = applied.sum()
        kept = applied.unsqueeze(1)
        mean = torch.where(kept, history, 0.0).sum(0) / count.clamp(min=1)
        variance = torch.where(kept, history - mean, 0.0).square().sum(0) / (count - 1).clamp(min=1)
        spread = torch.maximum(variance.sqrt(), _MIN_RELATIVE_STD * mean.abs())
        warm = count >= settings.warmup
        z = torch.where(warm & (spread > 0), (series - mean) / spread, math.nan)
        finite = torch.isfinite(series).all()
        false = torch.zeros((), dtype=torch.bool, device=series.device)
        rules = [  # in the order of GUARD_REASONS
            ~finite if settings.nonfinite and not scaler_skips_nonfinite else false,
            finite & (total > settings.max_grad_norm) if settings.max_grad_norm is not None else false,
            finite & (z[0] > settings.z_threshold) if settings.z_threshold is not None else false,
            finite & (z[1:].amax() > settings.z_threshold) if settings.z_threshold is not None
            and settings.per_parameter else false,
        ]
        reason = torch.zeros((), dtype=torch.float32, device=series.device)
        for code in range(len(rules), 0, -1):  # the first rule that fires names the reason
            reason = torch.where(rules[code - 1], float(code), reason)
        # the parameter it names: the first non-finite one, else the largest z-score, else the largest norm
        first_nonfinite = torch.argmax((~torch.isfinite(norms)).to(torch.float32))
        largest_z = torch.argmax(torch.nan_to_num(z[1:], nan=-math.inf))
        param = torch.where(~finite, first_nonfinite, torch.where(warm, largest_z, torch.argmax(norms))).view(1)
        skip = (reason > 0).to(torch.float32)
        verdict = torch.stack([skip, reason, param[0].to(torch.float32), norms.gather(0, param)[0],
                               torch.where(warm, mean[1:].gather(0, param)[0], math.nan), z[1:].gather(0, param)[0],
                               total, torch.where(warm, mean[0], math.nan), z[0]])
        if record:
            self.decisions += 1
            row = self.decisions % settings.window  # a host count: the write needs no read of the device
            history[row] = series
            applied[row] = finite & (reason == 0)
        return verdict


class StepGuard:
    """Judges each step's gradients before the optimizer applies them, and skips a poisoned step.

    Args:
        settings: the ``anomaly.guard`` config section.
        optimizer: the torch optimizer (behind any trainer's wrapper).
        names: ``id(parameter) -> name`` (a parameter missing here is named by its place in the optimizer).
        guard: the monitor's fail-safe guard.
        on_decided: told each decision (the skip flag: a device tensor or a float) and that the step is over
            (the step model: ``step_skipped``, and a step the guard skipped still ends).
        reduce_group: the process group whose ranks hold shards of each gradient (FSDP2's shard group): their
            squared norms are summed over it; None where every rank holds whole gradients.
    """

    def __init__(self, settings: GuardConfig, optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                 guard: Guard, on_decided: Callable[[torch.Tensor | float], None], reduce_group: Any = None) -> None:
        self.settings = settings
        self.optimizer = optimizer
        self.parts = optimizer_parts(optimizer)
        self._names_by_id = dict(names)
        self.guard = guard
        self.on_decided = on_decided
        self.reduce_group = reduce_group
        self.device_flag = takes_device_flag(optimizer)
        self.params: list[torch.Tensor] = []
        self.names: list[str] = []
        """The optimizer's parameters' names, in the order of the verdict's ``param`` index."""
        self.verdict: torch.Tensor | list[float] | None = None
        """This step's :data:`~trainmon.base.records.GUARD_VERDICT` (on the device, or read on the host)."""
        self.judge = GradientJudge(settings)
        self._inside = False
        self._bypassed_warned = False
        self._wrapper = StepWrapper(optimizer, around=self._step).install()
        self._check = optimizer.register_step_pre_hook(guard.wrap(PART, self._check_inside))
        self._refresh_params()

    def close(self) -> None:
        self._wrapper.uninstall()
        self._check.remove()

    def take(self) -> dict[str, Any]:
        """This step's verdict as scalars (``step_guard/{name}``; the skip flag goes as ``step_skipped`` through the
        step model), then forgotten; ``{}`` when the optimizer did not step (or trainmon's part failed)."""
        verdict, self.verdict = self.verdict, None
        return verdict_scalars(verdict)

    # ------------------------------------------------------------------ the wrapped step
    def _step(self, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.guard.off(PART) or state_dict_init_step():  # failed earlier (or the monitor stopped), or not a
            return inner(*args, **kwargs)  # training step: the step as without the guard
        closure = kwargs.get("closure", args[0] if args else None)
        loss = None
        if closure is not None:  # the user's code, outside trainmon's guard: the gradients exist after it
            with torch.enable_grad():
                loss = closure()
            args, kwargs = _replayed(closure, loss, args, kwargs)
        decision = self.guard.run(PART, self._decide)  # None: trainmon failed (or is off): applied as usual
        if decision is _SKIP:
            return loss
        return self._call(inner, args, kwargs, decision if isinstance(decision, torch.Tensor) else None)

    def _call(self, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              found_inf: torch.Tensor | None) -> Any:
        """The optimizer's own step; with ``found_inf`` as its device flag (a GradScaler's put back after)."""
        namespace = self.optimizer.__dict__
        previous = namespace.get("found_inf")
        if found_inf is not None:
            namespace["found_inf"] = found_inf
        self._inside = True
        try:
            return inner(*args, **kwargs)
        finally:
            self._inside = False
            if found_inf is not None and namespace.get("found_inf") is found_inf:
                if previous is None:
                    del namespace["found_inf"]
                else:
                    namespace["found_inf"] = previous

    def _check_inside(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """A step pre-hook: the step was reached without the guard's wrapper (something replaced ``step`` on the
        instance after attach): say so once, loudly; that step is not guarded."""
        if not self._inside and not self._bypassed_warned:
            self._bypassed_warned = True
            logger.error("trainmon: %s.step() ran without the step guard (something replaced optimizer.step on the "
                         "instance after attach); steps that bypass it are not guarded", type(optimizer).__name__)

    # ------------------------------------------------------------------ the decision (trainmon's part)
    def _decide(self) -> torch.Tensor | str:
        """Judge the gradients; returns the device flag for a fused optimizer, else ``apply``/``skip``."""
        self._refresh_params()
        grads = [p.grad for p in self.params]
        if all(grad is None for grad in grads):
            return _APPLY  # nothing to apply: no verdict
        scaler_flag = self.optimizer.__dict__.get("found_inf")  # a GradScaler's, on the fused path
        scale = self.optimizer.__dict__.get("grad_scale")  # a GradScaler's, when the fused kernel unscales
        norms = self.judge.norms(grads, self.reduce_group, scale if isinstance(scale, torch.Tensor) else None)
        verdict = self.judge.judge(norms, scaler_skips_nonfinite=isinstance(scaler_flag, torch.Tensor))
        if self.device_flag and self._flag_is_safe():
            skip = verdict[0]
            self.verdict = verdict
            self.on_decided(skip)
            if isinstance(scaler_flag, torch.Tensor):
                return torch.maximum(skip, (scaler_flag > 0).to(skip.device, torch.float32))
            return skip
        values: list[float] = verdict.tolist()  # sync: the one host read of a step without a device flag
        self.verdict = values
        self.on_decided(values[0])
        return _SKIP if values[0] > 0 else _APPLY

    def _flag_is_safe(self) -> bool:
        """Whether a skip through the fused kernel leaves the state as a run without the step would: not for an SGD
        with momentum before its buffers exist (its first step makes them uninitialised, and keeps them)."""
        if not isinstance(self.optimizer, torch.optim.SGD):
            return True
        state = self.optimizer.state
        return all(group["momentum"] == 0 or all(
            p.grad is None or state.get(p, {}).get("momentum_buffer") is not None for p in group["params"])
            for group in self.optimizer.param_groups)

    def _refresh_params(self) -> None:
        """The optimizer's parameters as they are now; the history starts again when they changed."""
        params = [p for group in param_groups_of(self.parts) for p in group["params"]]
        if len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params)):
            return
        self.params = params
        self.names[:] = [self._names_by_id.get(id(p), f"optimizer parameter {i}") for i, p in enumerate(params)]
        self.judge.reset()


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor gradient (a view), a plain gradient as it is."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if to_local is not None else grad


def _replayed(closure: Callable[[], Any], loss: Any, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The step's arguments with a closure whose first call returns ``loss`` (the closure already ran) and whose
    later calls (LBFGS re-evaluates) call the user's."""
    called = False

    def replay() -> Any:
        nonlocal called
        if called:
            return closure()
        called = True
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": replay}
    return (replay, *args[1:]), kwargs
