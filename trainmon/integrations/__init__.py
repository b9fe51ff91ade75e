"""Framework integrations; each is imported only when its objects are attached."""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from trainmon.actions.frameworks import Framework
    from trainmon.base.types import Model
    from trainmon.integrations.base import Integration


def framework_of(model: Model) -> str:
    """Which integration handles ``model``: torch, fsdp, deepspeed, megatron or mindspore.

    Detection looks at the type's module, so no framework is imported to decide.
    """
    first = model[0] if isinstance(model, (list, tuple)) and model else model
    modules = [cls.__module__ for cls in type(first).__mro__]
    for framework in ("deepspeed", "megatron", "mindspore"):
        if any(m.split(".")[0] == framework for m in modules):
            return framework
    if "torch.distributed.fsdp" in sys.modules:  # an FSDP module can exist only once torch imported it
        from trainmon.integrations.fsdp.layout import contains_fsdp

        if contains_fsdp(first):
            return "fsdp"
    return "torch"


def actions_framework(model: Model) -> Framework:
    """The adapter the anomaly actions (dump, free benchmark, localiser) use for ``model``: a module (inside any
    DDP or DeepSpeed wrapper), a list of Megatron-Core chunks or a MindSpore cell; its framework from
    :func:`framework_of`, and only that framework's adapter imported."""
    framework = framework_of(model)
    if framework == "mindspore":
        from trainmon.integrations.mindspore.actions import MindSporeFramework

        return MindSporeFramework()
    if framework == "fsdp":
        from trainmon.integrations.fsdp.actions import FSDPFramework

        return FSDPFramework(model[0] if isinstance(model, (list, tuple)) and model else model)
    if framework == "megatron":
        from trainmon.integrations.megatron.actions import MegatronFramework

        return MegatronFramework()
    from trainmon.actions.frameworks import TorchFramework

    return TorchFramework()


def load(framework: str) -> Integration:
    """The integration module for ``framework`` (imported lazily)."""
    name = {"torch": "torch", "fsdp": "fsdp", "deepspeed": "deepspeed", "megatron": "megatron",
            "mindspore": "mindspore"}[framework]
    try:
        return cast("Integration", importlib.import_module(f"trainmon.integrations.{name}"))
    except ImportError as exc:
        raise ImportError(f"the {framework} integration needs its framework: pip install 'trainmon[{framework}]' "
                          f"({exc})") from exc


if TYPE_CHECKING:  # read by mypy only: each integration module satisfies the protocol (never imported at run time)
    from trainmon.integrations import deepspeed, fsdp, megatron, mindspore
    from trainmon.integrations import torch as torch_integration

    _INTEGRATIONS: tuple[Integration, ...] = (torch_integration, fsdp, deepspeed, megatron, mindspore)
