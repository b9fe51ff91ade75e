"""What the anomaly actions need from a framework: tensor descriptions and statistics, module hooks.

The dump, the free benchmark and the non-finite localiser are written once against
:class:`Framework`; :class:`TorchFramework` serves plain torch, DDP and DeepSpeed models; the
integrations subclass or implement it for their framework (``trainmon.integrations.megatron.actions.MegatronFramework``
for Megatron-Core chunks, ``trainmon.integrations.fsdp.actions.FSDPFramework`` for FSDP2 models,
``trainmon.integrations.mindspore.actions.MindSporeFramework`` for MindSpore cells), and
:func:`trainmon.integrations.actions_framework` picks one from the model. The actions never import an integration:
the adapter is handed to them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import IO, TYPE_CHECKING, Any, Protocol

import torch

from trainmon.collect.context import in_backward
from trainmon.collect.hooks import post_accumulate_grad_hook

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from trainmon.actions.perturb import RerunOps

Hook = Callable[..., Any]
ForwardPreHook = Callable[[Any, tuple[Any, ...], dict[str, Any]], None]
"""A forward pre-hook given the keyword arguments too: ``(module, args, kwargs)``."""
ForwardHook = Callable[[Any, tuple[Any, ...], dict[str, Any], Any], Any]
"""A forward hook given the keyword arguments too: ``(module, args, kwargs, output)``; not None replaces the output."""
GradHook = Callable[[Any], None]
"""A gradient hook of a tensor or a parameter: ``(grad)``."""
CellBackwardHook = Callable[[Any, Any, Any], None]
"""A MindSpore cell backward hook: ``(cell, grad_input, grad_output)``."""


class Framework(Protocol):
    """The framework-specific half of the anomaly actions (everything else is shared)."""

    name: str
    """``framework`` in ``dump.json``: ``pytorch`` or ``mindspore``."""
    module_prefix: str
    """First part of a dump key: ``Module`` (torch) or ``Cell`` (MindSpore), as msprobe writes them."""
    file_suffix: str
    """Tensor files of ``tensor`` mode: ``.pt`` (torch.save) or ``.npy`` (numpy.save)."""
    @property
    def tensor_type(self) -> type:
        """The framework's tensor class (read only: each implementation names its own)."""
        ...

    tensor_gradients: bool
    """True: backward entries come from gradient hooks on the tensors (torch); False: from a module
    backward hook that gets ``(module, grad_input, grad_output)`` (MindSpore)."""

    # ---- module tree and hooks
    def named_modules(self, root: Any) -> Iterable[tuple[str, Any]]: ...
    def children(self, module: Any) -> Iterable[tuple[str, Any]]: ...
    def own_parameters(self, module: Any) -> list[tuple[str, Any]]: ...
    def unwrap(self, chunk: Any) -> Any:
        """The model inside the framework's wrappers of a model chunk (the chunk itself when unwrapped)."""
        ...
    def class_name(self, module: Any) -> str:
        """The module's class in dump keys (``Module.{name}.{Class}``), as the user's code names it."""
        ...
    wrap: Callable[[Hook], Hook]
    """Applied to every hook before it is registered: the session puts the action's fail-safe guard here."""
    def forward_pre_hook(self, module: Any, hook: Hook) -> Any: ...
    def forward_hook(self, module: Any, hook: Hook) -> Any: ...
    def backward_hook(self, module: Any, hook: Hook) -> Any: ...
    def tensor_hook(self, tensor: Any, hook: Hook) -> Any: ...
    def param_grad_hook(self, param: Any, hook: Hook) -> Any: ...
    def grad_enabled(self) -> bool: ...
    def is_rerun(self) -> bool: ...

    # ---- tensors
    def describe_tensor(self, tensor: Any) -> dict[str, Any]: ...
    def describe_other(self, value: Any) -> dict[str, Any] | None: ...
    def statistics(self, tensor: Any) -> Any | None: ...
    def extremes(self, tensor: Any) -> Any | None: ...
    def nonfinite_rows(self, extremes: list[Any]) -> list[bool]: ...
    def to_host(self, stats: list[Any]) -> list[list[float]]: ...
    def nbytes(self, tensor: Any) -> int: ...
    def host_copy(self, tensor: Any) -> Any: ...
    def save(self, host: Any, handle: IO[bytes]) -> None: ...
    def host_bytes(self, host: Any) -> bytes: ...

    # ---- free benchmark
    def rerun_ops(self) -> RerunOps: ...


class TorchFramework:
    """torch modules (also inside DDP, DeepSpeed and Megatron-Core wrappers).

    Args:
        megatron: the model is Megatron-Core: a forward inside ``tensor_parallel.checkpoint`` with
            grad enabled is a recompute re-run (``MegatronFramework`` in the Megatron integration sets it,
            and reads a parameter's gradient before the data-parallel reduction).
    """

    name = "pytorch"
    module_prefix = "Module"
    file_suffix = ".pt"
    tensor_type = torch.Tensor
    tensor_gradients = True

    def __init__(self, megatron: bool = False) -> None:
        self.megatron = megatron
        self.wrap: Callable[[Hook], Hook] = _unwrapped
        self._is_checkpointing: Callable[[], bool] | None = None
        if megatron:
            from megatron.core.tensor_parallel.random import is_checkpointing

            self._is_checkpointing = is_checkpointing

    # ------------------------------------------------------------------ module tree and hooks
    def named_modules(self, root: torch.nn.Module) -> Iterable[tuple[str, torch.nn.Module]]:
        modules: Iterable[tuple[str, torch.nn.Module]] = root.named_modules()
        return modules

    def children(self, module: torch.nn.Module) -> Iterable[tuple[str, torch.nn.Module]]:
        return module.named_children()

    def own_parameters(self, module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
        return list(module.named_parameters(recurse=False))

    def class_name(self, module: torch.nn.Module) -> str:
        return type(module).__name__

    def unwrap(self, chunk: torch.nn.Module) -> torch.nn.Module:
        return chunk

    def accumulated_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient the parameter has accumulated on this rank so far (read in its accumulation hook)."""
        return param.grad

    def forward_pre_hook(self, module: torch.nn.Module, hook: Hook) -> Any:
        return module.register_forward_pre_hook(self.wrap(hook), with_kwargs=True)

    def forward_hook(self, module: torch.nn.Module, hook: Hook) -> Any:
        return module.register_forward_hook(self.wrap(hook), with_kwargs=True)

    def backward_hook(self, module: torch.nn.Module, hook: Hook) -> Any:
        raise NotImplementedError("torch backward entries come from tensor hooks")

    def tensor_hook(self, tensor: torch.Tensor, hook: Hook) -> Any:
        """A gradient hook on a non-leaf tensor of the graph (None for leaves: parameters, user data)."""
        if tensor.grad_fn is None:
            return None
        register: Callable[[Hook], RemovableHandle] = tensor.register_hook  # unannotated in torch
        return register(self.wrap(hook))

    def param_grad_hook(self, param: torch.nn.Parameter, hook: Hook) -> Any:
        """``hook(gradient)`` once the parameter's gradient is accumulated (each backward)."""
        def on_accumulated(tensor: torch.Tensor) -> None:
            grad = self.accumulated_grad(tensor)
            if grad is not None:
                hook(grad)

        return post_accumulate_grad_hook(param, self.wrap(on_accumulated))

    def grad_enabled(self) -> bool:
        return torch.is_grad_enabled()

    def is_rerun(self) -> bool:
        """A recompute re-run of a checkpointed forward (it runs inside autograd's backward pass, or,
        in Megatron's ``tensor_parallel.checkpoint``, with grad enabled while checkpointing)."""
        if in_backward():
            return True
        checkpointing = self._is_checkpointing
        return checkpointing is not None and torch.is_grad_enabled() and checkpointing()

    # ------------------------------------------------------------------ tensors
    def describe_tensor(self, tensor: torch.Tensor) -> dict[str, Any]:
        desc: dict[str, Any] = {"type": "torch.Tensor", "dtype": str(tensor.dtype), "shape": list(tensor.shape),
                                "Max": None, "Min": None, "Mean": None, "Norm": None,
                                "requires_grad": bool(tensor.requires_grad)}
        if self.megatron and getattr(tensor, "tensor_model_parallel", False):
            desc["tp_partition_dim"] = int(getattr(tensor, "partition_dim", -1))
        return desc

    def describe_other(self, value: Any) -> dict[str, Any] | None:
        if isinstance(value, (torch.dtype, torch.device, torch.Size, slice)):
            return {"type": type(value).__name__, "value": str(value)}
        return None

    def statistics(self, tensor: torch.Tensor) -> torch.Tensor | None:
        return tensor_statistics(tensor)

    def extremes(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """``[min, max]`` on the device (one kernel; NaN propagates): non-finite exactly when the tensor is."""
        x = tensor.detach()
        if x.numel() == 0 or not (x.is_floating_point() or x.is_complex()):
            return None
        if x.is_complex():
            x = torch.view_as_real(x)
        lo, hi = torch.aminmax(x)
        return torch.stack([lo, hi]).to(torch.float32)

    def nonfinite_rows(self, extremes: list[torch.Tensor]) -> list[bool]:
        if not extremes:
            return []
        by_device: dict[torch.device, list[int]] = {}
        for i, pair in enumerate(extremes):
            by_device.setdefault(pair.device, []).append(i)
        out = [False] * len(extremes)
        for indices in by_device.values():
            flags = ~torch.isfinite(torch.stack([extremes[i] for i in indices])).all(dim=1)
            for i, flag in zip(indices, flags.cpu().tolist()):  # sync: the localiser's one transfer per step
                out[i] = bool(flag)
        return out

    def to_host(self, stats: list[torch.Tensor]) -> list[list[float]]:
        return to_host(stats)

    def nbytes(self, tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to("cpu", copy=True)  # sync: the dump's host copy (dump steps only)

    def save(self, host: torch.Tensor, handle: IO[bytes]) -> None:
        torch.save(host.contiguous().clone(), handle)

    def host_bytes(self, host: torch.Tensor) -> bytes:
        # no sync: a host tensor, on a dump step (an action, not the hot path)
        return host.contiguous().view(torch.uint8).numpy().tobytes()  # CPU view, no sync

    # ------------------------------------------------------------------ free benchmark
    def rerun_ops(self) -> RerunOps:
        from trainmon.actions.perturb import TorchRerunOps

        return TorchRerunOps(megatron=self.megatron)


def megatron_layout() -> dict[str, int] | None:
    """``{tp_rank, tp_size, pp_rank, pp_size}`` from Megatron's ``parallel_state`` when it is initialised."""
    state = sys.modules.get("megatron.core.parallel_state")
    if state is None or not state.model_parallel_is_initialized():
        return None
    return {"tp_rank": state.get_tensor_model_parallel_rank(), "tp_size": state.get_tensor_model_parallel_world_size(),
            "pp_rank": state.get_pipeline_model_parallel_rank(),
            "pp_size": state.get_pipeline_model_parallel_world_size()}


def _unwrapped(hook: Hook) -> Hook:
    """The default :attr:`Framework.wrap`: the hook as it is."""
    return hook


def tensor_statistics(tensor: torch.Tensor) -> torch.Tensor | None:
    """``[Max, Min, Mean, Norm]`` of a tensor on its device (no host sync); None when empty.

    Low-precision and integer tensors are measured in float32, float64 tensors in float64.
    """
    x = tensor.detach()
    if x.numel() == 0:
        return None
    if x.is_complex():
        x = torch.view_as_real(x)
    if not x.is_floating_point():
        x = x.to(torch.float32)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    lo, hi = torch.aminmax(x)
    return torch.stack([hi.to(acc), lo.to(acc), x.mean(dtype=acc), torch.linalg.vector_norm(x, dtype=acc)])


def to_host(tensors: list[torch.Tensor]) -> list[list[float]]:
    """Copy ``[4]`` statistics tensors to the host with one transfer per device."""
    out: list[list[float]] = [[] for _ in tensors]
    by_device: dict[torch.device, list[int]] = {}
    for i, tensor in enumerate(tensors):
        by_device.setdefault(tensor.device, []).append(i)
    for device, indices in by_device.items():
        dtype = torch.float64 if device.type in ("cpu", "cuda") else torch.float32
        stacked = torch.stack([tensors[i].to(dtype) for i in indices])
        values = stacked.cpu().tolist()  # sync: the one statistics transfer of a dump step
        for i, row in zip(indices, values):
            out[i] = row
    return out
