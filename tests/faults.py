"""Fault injection for the fail-safe tests: one of trainmon's own functions raises, from its N-th call on.

Each fault names a place trainmon runs inside the user's training (a hook kind), the function there that is
made to raise, and the guard part that must be switched off. :func:`inject` patches the class attribute (so the
monitor must be attached after it), in this process: multi-process scripts call it in each rank.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class InjectedFault(RuntimeError):
    """The exception the injected faults raise (trainmon's own, as far as the training loop can tell)."""


@dataclass(frozen=True)
class Fault:
    """Where to inject: ``module.owner.attribute`` raises from its ``after``-th call on (``when`` filters calls).

    ``factory``: the attribute makes hooks (``_grad_hook(name, vpp)`` returns the hook): the hooks it makes raise.
    """

    module: str
    owner: str
    attribute: str
    part: str
    when: Callable[..., bool] | None = None
    factory: bool = False


FAULTS: dict[str, Fault] = {
    # torch module forward hook (actv), then backward hook (actv_grad): both measured through GroupedRows
    "forward_hook": Fault("trainmon.collect.grouped", "GroupedRows", "record", "activations",
                          when=lambda self, family, *a, **k: family == "actv"),
    "backward_hook": Fault("trainmon.collect.grouped", "GroupedRows", "record", "activations",
                           when=lambda self, family, *a, **k: family == "actv_grad"),
    # the parameter's post-accumulate-grad hook (grad_unreduced)
    "grad_hook": Fault("trainmon.collect.optimizer", "TorchOptimizerCollector", "_grad_hook", "weights",
                       factory=True),
    # the optimizer's step pre-hook (grad_reduced, param) and post-hook (optimizer states)
    "optimizer_pre_hook": Fault("trainmon.collect.optimizer", "TorchOptimizerCollector", "_measure_step", "weights"),
    "optimizer_post_hook": Fault("trainmon.collect.optimizer", "TorchOptimizerCollector", "_post_step", "weights"),
    # the end of the backward pass (autograd's final callback: grad_norm)
    "backward_end": Fault("trainmon.collect.optimizer", "TorchOptimizerCollector", "_backward_ended", "weights"),
    # the end of the step, before the one transfer
    "step_end": Fault("trainmon.collect.optimizer", "TorchOptimizerCollector", "before_transfer", "weights"),
    # the step guard's decision (inside the wrapped optimizer step; DeepSpeed's engine step; Megatron's prepare_grads)
    "step_guard": Fault("trainmon.collect.step_guard", "StepGuard", "_decide", "step_guard"),
    "deepspeed_step_guard": Fault("trainmon.integrations.deepspeed.guard", "DeepSpeedStepGuard", "_decide",
                                  "step_guard"),
    "megatron_step_guard": Fault("trainmon.integrations.megatron.guard", "MegatronStepGuard", "_decide", "step_guard"),
    "mindspore_step_guard": Fault("trainmon.integrations.mindspore.guard", "MindSporeStepGuard", "_decide",
                                  "step_guard"),
    # the anomaly detectors
    "anomaly": Fault("trainmon.anomaly.engine", "AnomalyEngine", "process", "anomaly"),
    # the step model (a root forward pre-hook): fatal, the whole monitor stops
    "step_model": Fault("trainmon.runtime.lifecycle", "StepLifecycle", "_maybe_end_training", "step"),
    # the step model's global optimizer post-hook (ends a step in which no root forward ran)
    "step_model_optimizer": Fault("trainmon.runtime.lifecycle", "StepLifecycle", "_after_optimizer_step", "step"),
    # a torch.distributed collective wrapper
    "collective": Fault("trainmon.collect.comm", "CommCollector", "_measure", "communication"),
    # DeepSpeed: the engine's step wrapper (ZeRO shards' statistics)
    "engine_step": Fault("trainmon.integrations.deepspeed", "DeepSpeedShardCollector", "_pre_step", "weights"),
    # FSDP2: the forward pre-hook that finds the unsharded parameters
    "fsdp_unsharded": Fault("trainmon.integrations.fsdp.unsharded", "UnshardedGradHooks", "_pre_forward", "weights",
                            factory=True),
    # FSDP2: the optimizer's step post-hook (sharded optimizer states)
    "fsdp_post_step": Fault("trainmon.integrations.fsdp", "FSDPOptimizerCollector", "_post_step", "weights"),
    # DeepSpeed: the end of the step (the shards' one all-gather)
    "engine_step_end": Fault("trainmon.integrations.deepspeed", "DeepSpeedShardCollector", "before_transfer",
                             "weights"),
    # Megatron-Core: the distributed optimizer's step pre-hook, a main_grad accumulation hook, the end of the step
    "megatron_step": Fault("trainmon.integrations.megatron.collect", "MegatronParamCollector", "_pre_step", "weights"),
    "megatron_grad_hook": Fault("trainmon.integrations.megatron.collect", "MegatronParamCollector", "_grad_hook",
                                "weights", factory=True),
    "megatron_step_end": Fault("trainmon.integrations.megatron.collect", "MegatronParamCollector", "before_transfer",
                               "weights"),
    # MindSpore: a cell's forward hook (actv) and the optimizer cell's forward pre-hook
    "mindspore_forward": Fault("trainmon.collect.grouped", "GroupedRows", "record", "activations",
                               when=lambda self, family, *a, **k: family == "actv"),
    "mindspore_optimizer": Fault("trainmon.integrations.mindspore.optimizer", "MindSporeOptimizerCollector",
                                 "_pre_step_hook", "weights", factory=True),
    "mindspore_post_step": Fault("trainmon.integrations.mindspore.optimizer", "MindSporeOptimizerCollector",
                                 "_post_step_hook", "weights", factory=True),
    "mindspore_grad_hook": Fault("trainmon.integrations.mindspore.optimizer", "MindSporeOptimizerCollector",
                                 "_grad_hook", "weights", factory=True),
}


def inject(kind: str, after: int = 3) -> Fault:
    """Make the function of fault ``kind`` raise :class:`InjectedFault` from its ``after``-th matching call on.

    Returns the :class:`Fault` (its ``part`` is what the warning must name). The patch stays for the life of
    the process (tests use it through pytest's ``monkeypatch``: see :func:`patched`).
    """
    fault = FAULTS[kind]
    owner = getattr(importlib.import_module(fault.module), fault.owner)
    setattr(owner, fault.attribute, faulty(getattr(owner, fault.attribute), fault, after))
    return fault


def faulty(original: Callable[..., Any], fault: Fault, after: int) -> Callable[..., Any]:
    """``original`` made to raise from its ``after``-th matching call on (or the hooks it makes, for a factory)."""
    calls = [0]

    def count_and_raise() -> None:
        calls[0] += 1
        if calls[0] >= after:
            raise InjectedFault(f"injected fault in {fault.owner}.{fault.attribute} (call {calls[0]})")

    if fault.factory:
        def make(*args: Any, **kwargs: Any) -> Any:
            hook = original(*args, **kwargs)

            def raising(*hook_args: Any, **hook_kwargs: Any) -> Any:
                count_and_raise()
                return hook(*hook_args, **hook_kwargs)

            return raising

        return make

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if fault.when is None or fault.when(*args, **kwargs):
            count_and_raise()
        return original(*args, **kwargs)

    return wrapper


def patched(monkeypatch: Any, kind: str, after: int = 3) -> Fault:
    """:func:`inject` through pytest's ``monkeypatch`` (undone after the test)."""
    fault = FAULTS[kind]
    owner = getattr(importlib.import_module(fault.module), fault.owner)
    monkeypatch.setattr(owner, fault.attribute, faulty(getattr(owner, fault.attribute), fault, after))
    return fault
