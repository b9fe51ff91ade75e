"""``print_struct``: the module tree with the shapes and dtypes seen in the first collected step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainmon.collect.hooks import ForwardHook, HookedCollector, HookRegistry
from trainmon.collect.tensor_names import named_tensors

if TYPE_CHECKING:
    from trainmon.collect.context import StepContext

_GROUP = "struct"


class StructRecorder(HookedCollector):
    """Records input/output shapes and dtypes (metadata only: no sync) of every module once."""

    HOOK_GROUPS = (_GROUP,)
    PART = "print_struct"

    def __init__(self, ctx: StepContext, modules: Sequence[tuple[str, torch.nn.Module, int]],
                 registry: HookRegistry) -> None:
        super().__init__(ctx, registry)
        self.modules = list(modules)
        self.seen: dict[str, dict[str, Any]] = {}
        self.done = False

    def install_hooks(self) -> None:
        if self.done:
            return
        for name, module, vpp_stage in self.modules:
            hook = self.guarded(self._hook(name or "(root)", vpp_stage))
            self.registry.add(_GROUP, module.register_forward_hook(hook, with_kwargs=True))

    def _hook(self, name: str, vpp_stage: int) -> ForwardHook:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if name in self.seen:
                return
            describe = {row: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                        for value, prefix in ((args, "input"), (kwargs, "input"), (output, "output"))
                        for row, t in named_tensors(value, prefix)}
            self.seen[name] = {"class": type(module).__name__, "vpp_stage": vpp_stage, "tensors": describe}

        return hook

    def tree(self) -> dict[str, Any]:
        """``{name: {class, vpp_stage, tensors, children}}`` nested by module path."""
        root: dict[str, Any] = {"children": {}}
        for name, module, vpp_stage in self.modules:
            node = root
            for part in name.split(".") if name else []:
                node = node["children"].setdefault(part, {"children": {}})
            node.update(self.seen.get(name or "(root)", {"class": type(module).__name__, "vpp_stage": vpp_stage,
                                                         "tensors": {}}))
        return root
