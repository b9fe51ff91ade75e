"""Which framework adapter the anomaly actions use for a model (:func:`framework_for`).

Apart from :mod:`trainmon.actions.frameworks` because it imports the adapters that build on it (FSDP2's,
MindSpore's): the adapters import ``frameworks``, this module imports them, never the reverse.
"""

from __future__ import annotations

from typing import Any

from trainmon.actions.frameworks import Framework, TorchFramework


def framework_for(model: Any) -> Framework:
    """The adapter for ``model`` (a module, a list of Megatron chunks, a MindSpore cell)."""
    first = model[0] if isinstance(model, (list, tuple)) and model else model
    if any(cls.__module__.split(".")[0] == "mindspore" for cls in type(first).__mro__):
        from trainmon.integrations.mindspore.actions import MindSporeFramework

        return MindSporeFramework()
    from trainmon.integrations.fsdp_layout import contains_fsdp

    if contains_fsdp(first):
        from trainmon.integrations.fsdp_actions import FSDPFramework

        return FSDPFramework(first)
    return TorchFramework(megatron=any(cls.__module__.split(".")[0] == "megatron" for cls in type(first).__mro__))
