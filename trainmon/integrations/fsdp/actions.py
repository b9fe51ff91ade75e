"""The anomaly actions (dump, free benchmark, non-finite localiser) on FSDP2 models (``fully_shard``).

FSDP2 keeps each parameter sharded (a ``DTensor``) between forwards and swaps the unsharded
parameter into its module for the forward of the FSDP module that manages it (its forward
pre-hook all-gathers, its forward hook reshards). :class:`FSDPFramework` is the torch adapter of
:mod:`trainmon.actions.frameworks` with three differences, so that the actions see the full
values a module used and never communicate:

- forward hooks of FSDP modules run *before* FSDP's own (``prepend``), while the parameters are
  still unsharded (forward pre-hooks already run after FSDP's, which it prepends itself);
- a parameter-gradient hook goes on the unsharded parameter, found by a forward pre-hook of the
  module that owns it, and sees this rank's whole gradient before FSDP reduce-scatters it (as
  ``grad_unreduced`` does; a hook on the sharded parameter would only see the reduced shard);
- a tensor that is still a ``DTensor`` when captured is measured and copied as this rank's shard
  (``to_local()``), never gathered: an action runs on the ranks whose anomaly asked for it, so a
  collective there could wait forever for the others.

The free benchmark re-runs a hook-free copy of the module with FSDP's classes removed, on the
unsharded parameters it holds during its forward. A module that contains another FSDP module whose
parameters are sharded again by then (the root, with ``reshard_after_forward``) is not re-run:
that would need an all-gather on this rank alone. Which modules are skipped depends only on the
model, so every rank takes the same path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from trainmon.actions.frameworks import Hook, TorchFramework
from trainmon.actions.perturb import CollectiveInRerun, TorchRerunOps, shallow_shadow

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def _fsdp_module_class() -> type:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def _is_dtensor(tensor: Any) -> TypeGuard[DTensor]:
    return hasattr(tensor, "to_local") and hasattr(tensor, "placements")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view, no communication); a plain tensor as it is."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


class _Handles:
    """Several hook handles removed as one (what ``param_grad_hook`` returns under FSDP)."""

    def __init__(self) -> None:
        self.handles: list[Any] = []

    def remove(self) -> None:
        handles, self.handles = self.handles, []
        for handle in handles:
            handle.remove()


class FSDPFramework(TorchFramework):
    """torch modules sharded with FSDP2 ``fully_shard`` (also HSDP); see the module docstring.

    Args:
        model: the root module; its module tree says which module owns each sharded parameter.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self._owners: dict[int, tuple[torch.nn.Module, str]] = {
            id(param): (module, name)
            for module in model.modules() for name, param in module._parameters.items() if param is not None}

    def class_name(self, module: torch.nn.Module) -> str:
        return _original_class(module).__name__  # Block, not FSDP's FSDPBlock: dumps compare with unsharded runs

    def forward_hook(self, module: torch.nn.Module, hook: Hook) -> Any:
        # FSDP's post-forward hook reshards its parameters: run before it, while they are unsharded.
        return module.register_forward_hook(self.wrap(hook), with_kwargs=True,
                                            prepend=isinstance(module, _fsdp_module_class()))

    def param_grad_hook(self, param: torch.nn.Parameter, hook: Hook) -> Any:
        """``hook(gradient)`` with this rank's whole gradient of ``param`` (before FSDP's reduce-scatter).

        A sharded parameter gets no hook itself: the forward pre-hook of its owner module hooks the
        unsharded parameter FSDP has set on it (once per object; FSDP reuses it every forward).
        """
        owner = self._owners.get(id(param))
        if not _is_dtensor(param) or owner is None:
            return super().param_grad_hook(param, hook)  # unsharded already (the root after an eval forward)
        module, attribute = owner
        handles = _Handles()
        hooked: set[int] = set()

        def find_unsharded(module: torch.nn.Module, args: Any) -> None:
            unsharded = module._parameters.get(attribute)
            if unsharded is None or _is_dtensor(unsharded) or not unsharded.requires_grad \
                    or id(unsharded) in hooked:
                return
            hooked.add(id(unsharded))
            handles.handles.append(super(FSDPFramework, self).param_grad_hook(unsharded, hook))

        handles.handles.append(module.register_forward_pre_hook(self.wrap(find_unsharded)))
        return handles

    # ------------------------------------------------------------------ tensors: a shard is never gathered
    def describe_tensor(self, tensor: torch.Tensor) -> dict[str, Any]:
        desc = super().describe_tensor(_local(tensor))
        if _is_dtensor(tensor):
            desc["dtensor_shard"] = {"placements": [str(p) for p in tensor.placements],
                                     "global_shape": list(tensor.shape)}
        return desc

    def statistics(self, tensor: torch.Tensor) -> torch.Tensor | None:
        return super().statistics(_local(tensor))

    def extremes(self, tensor: torch.Tensor) -> torch.Tensor | None:
        return super().extremes(_local(tensor))

    def nbytes(self, tensor: torch.Tensor) -> int:
        return super().nbytes(_local(tensor))

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return super().host_copy(_local(tensor))  # sync: the dump's host copy (dump steps only)

    def rerun_ops(self) -> FSDPRerunOps:
        return FSDPRerunOps()


class FSDPRerunOps(TorchRerunOps):
    """The torch re-run on a copy of an FSDP module without FSDP's classes, on its unsharded parameters."""

    def shadow(self, module: torch.nn.Module, mode: str) -> torch.nn.Module:
        """A hook-free copy of ``module`` as its original classes (FSDP's ``FSDP<Class>`` removed).

        Raises:
            CollectiveInRerun: a parameter is sharded at this point (a nested FSDP module resharded
                after its forward): re-running would all-gather it on this rank alone.
        """
        sharded = next((name for name, p in module.named_parameters() if _is_dtensor(p)), None)
        if sharded is not None:
            raise CollectiveInRerun(f"parameter {sharded!r} is sharded again by FSDP when the module's forward "
                                    "returns (a nested fully_shard module); re-running would all-gather it")
        return shallow_shadow(module, mode, copy_module=_without_fsdp_class)


def _original_class(module: torch.nn.Module) -> type:
    """The module's class before ``fully_shard`` (which swaps in a subclass ``FSDP<Class>``)."""
    fsdp = _fsdp_module_class()
    return next(c for c in type(module).__mro__ if not issubclass(c, fsdp))


def _without_fsdp_class(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``module`` as its original class (an FSDP module's copy has no FSDP behaviour).

    ``copy.copy`` cannot be used: ``FSDPModule.__new__`` constructs the original class by calling its
    ``__init__`` without arguments.
    """
    shadow: torch.nn.Module = object.__new__(_original_class(module))
    shadow.__dict__.update(module.__dict__)
    return shadow
