"""Perturbations of a module's inputs and the msprobe-style comparison of outputs (torch).

Everything here runs on the device and never synchronises with the host: the comparison
returns a 0-d tensor that the free benchmark copies to the host once at the end of the step.
:class:`TorchRerunOps` bundles them for :class:`~trainmon.actions.free_benchmark.FreeBenchmark`
(``trainmon.integrations.mindspore.actions`` has the MindSpore counterpart).
"""

from __future__ import annotations

import copy
import itertools
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainmon.base import process_groups

PERT_MODES: tuple[str, ...] = ("improve_precision", "add_noise", "bit_noise", "change_value", "no_change", "to_cpu")
LOW_PRECISION: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)

NOISE: dict[torch.dtype, float] = {torch.bfloat16: 1e-4, torch.float16: 1e-6, torch.float32: 1e-8, torch.float64: 1e-16}
"""The ε of ``add_noise``; its square root is also the magnitude below which values are not compared by ratio."""

RATIO_LIMIT: dict[torch.dtype, float] = {torch.float16: 1.002, torch.bfloat16: 1.004,
                                         torch.float32: 1.0002, torch.float64: 1.0002}
"""Largest elementwise ratio between original and perturbed output that still passes (msprobe's)."""

_HIGHER: dict[torch.dtype, torch.dtype] = {torch.float16: torch.float32, torch.bfloat16: torch.float32,
                                           torch.float32: torch.float64, torch.float64: torch.float64}
_INT_OF_SIZE: dict[int, torch.dtype] = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def converts_precision(mode: str) -> bool:
    """Whether ``mode`` runs the module in a higher precision (or on the CPU)."""
    return mode in ("improve_precision", "to_cpu")


def perturb_tensor(x: torch.Tensor, mode: str) -> torch.Tensor:
    """A perturbed copy of one input tensor; non-floating tensors come back unchanged (or moved to CPU).

    - ``improve_precision``: float16/bfloat16 -> float32.
    - ``add_noise``: +ε (by dtype, :data:`NOISE`) on elements with ``|x| > sqrt(ε)``.
    - ``bit_noise``: the lowest mantissa bit flipped on finite elements above the smallest normal.
    - ``change_value``: first and last elements (of the flattened tensor) swapped.
    - ``no_change``: the tensor itself (re-running catches non-determinism).
    - ``to_cpu``: a CPU copy, float16/bfloat16 -> float32 and float32 -> float64.
    """
    x = x.detach()
    if mode == "to_cpu":
        return x.to("cpu", _HIGHER.get(x.dtype, x.dtype)) if x.is_floating_point() else x.to("cpu")
    if not x.is_floating_point() or mode == "no_change":
        return x
    if mode == "improve_precision":
        return x.float() if x.dtype in LOW_PRECISION else x
    if mode == "add_noise":
        eps = NOISE[x.dtype]
        return torch.where(x.abs() > eps ** 0.5, x + eps, x)
    if mode == "bit_noise":
        int_type = _INT_OF_SIZE[x.element_size()]
        flipped = (x.contiguous().view(int_type) ^ 1).view(x.dtype)
        mask = torch.isfinite(x) & (x.abs() > torch.finfo(x.dtype).tiny)
        return torch.where(mask, flipped, x)
    if mode == "change_value":
        y = x.clone()
        flat = y.view(-1)
        if flat.numel() >= 2:
            first = flat[0].clone()
            flat[0] = flat[-1]
            flat[-1] = first
        return y
    raise ValueError(f"unknown perturbation {mode!r}; choose from {list(PERT_MODES)}")


def perturb_value(value: Any, mode: str) -> Any:
    """:func:`perturb_tensor` applied to every tensor in nested tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return perturb_tensor(value, mode)
    if isinstance(value, tuple):
        return tuple(perturb_value(v, mode) for v in value)
    if isinstance(value, list):
        return [perturb_value(v, mode) for v in value]
    if isinstance(value, dict):
        return {k: perturb_value(v, mode) for k, v in value.items()}
    return value


def _clear_hooks(module: torch.nn.Module) -> None:
    # The shadow is our own deep copy: drop the hooks it inherited so that re-running it
    # triggers neither our hooks nor the monitor's collectors nor the user's.
    for attr in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
                 "_backward_pre_hooks"):
        hooks = getattr(module, attr, None)
        if hooks is not None:
            hooks.clear()


def shadow_module(module: torch.nn.Module, mode: str) -> torch.nn.Module:
    """A hook-free copy of ``module`` to re-run; the original is never modified.

    Parameters are shared with the original unless ``mode`` changes their precision or device
    (then they are converted copies); buffers are always copied, so a re-run that updates them
    (batch-norm running statistics) leaves the original's untouched.

    Raises:
        Exception: whatever ``copy.deepcopy`` raises for a module that cannot be copied.
    """
    def convert(t: torch.Tensor) -> torch.Tensor:
        if mode == "to_cpu" or (mode == "improve_precision" and t.dtype in LOW_PRECISION):
            out = perturb_tensor(t, mode)
            # .to() returns the tensor itself when nothing changes (an int buffer already on the CPU).
            return out.clone() if out.data_ptr() == t.data_ptr() else out
        return t.detach().clone()

    memo: dict[int, Any] = {}
    for param in module.parameters():
        changed = mode == "to_cpu" or (mode == "improve_precision" and param.dtype in LOW_PRECISION)
        memo[id(param)] = torch.nn.Parameter(convert(param), requires_grad=False) if changed else param
    for buffer in module.buffers():
        memo[id(buffer)] = convert(buffer)
    shadow = copy.deepcopy(module, memo)
    for sub in shadow.modules():
        _clear_hooks(sub)
    return shadow


def flat_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value`` (nested tuples, lists, dicts), in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from flat_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from flat_tensors(item)


def replace_tensors(value: Any, new: Iterator[torch.Tensor]) -> Any:
    """``value`` with its tensors replaced, in :func:`flat_tensors` order, by those of ``new``."""
    if isinstance(value, torch.Tensor):
        return next(new)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(replace_tensors(v, new) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(replace_tensors(v, new) for v in value)
    if isinstance(value, dict):
        return type(value)((k, replace_tensors(v, new)) for k, v in value.items())
    return value


def max_ratio(original: torch.Tensor, perturbed: torch.Tensor) -> torch.Tensor:
    """The largest elementwise ratio ``max(|o|, |p|) / min(|o|, |p|)`` as a 0-d device tensor.

    Elements where both magnitudes are at most ``sqrt(ε)`` of the original dtype count as
    equal (ratio 1) and smaller magnitudes are clamped to ``sqrt(ε)``; a sign flip beyond that
    tolerance, a NaN/Inf on one side only, or a shape mismatch gives ``inf``. Matching NaNs
    and equal infinities count as equal.
    """
    device = original.device
    acc = torch.float64 if device.type in ("cpu", "cuda") else torch.float32
    if original.shape != perturbed.shape:
        return torch.full((), float("inf"), dtype=acc, device=device)
    if original.numel() == 0:
        return torch.ones((), dtype=acc, device=device)
    tol = NOISE.get(original.dtype, NOISE[torch.float32]) ** 0.5
    o = original.detach().to(acc)
    p = perturbed.detach().to(device=device, dtype=acc)
    a, b = o.abs(), p.abs()
    big = torch.maximum(a, b)
    ratio = big / torch.clamp(torch.minimum(a, b), min=tol)
    one = torch.ones((), dtype=acc, device=device)
    inf = torch.full((), float("inf"), dtype=acc, device=device)
    ratio = torch.where(big <= tol, one, ratio)
    ratio = torch.where((o * p < 0) & (big > tol), inf, ratio)
    same = torch.isnan(o) & torch.isnan(p) | (o == p)
    ratio = torch.where(torch.isfinite(o) & torch.isfinite(p), ratio, torch.where(same, one, inf))
    return ratio.max()


def straight_through(original: torch.Tensor, better: torch.Tensor) -> torch.Tensor:
    """``better``'s value in ``original``'s dtype and device, with ``original``'s gradient path."""
    if not original.requires_grad:
        return better.to(device=original.device, dtype=original.dtype)
    reference = original.float()
    delta = better.to(device=original.device, dtype=torch.float32) - reference.detach()
    return (reference + delta).to(original.dtype)


def device_rng_states(tensors: Iterator[torch.Tensor]) -> tuple[str | None, list[int], list[torch.Tensor]]:
    """``(device type, device indices, RNG states)`` of the accelerators the tensors live on."""
    devices = sorted({(t.device.type, t.device.index or 0) for t in tensors if t.device.type != "cpu"})
    if not devices:
        return None, [], []
    device_type = devices[0][0]
    indices = [index for kind, index in devices if kind == device_type]
    module = torch.get_device_module(device_type)
    return device_type, indices, [module.get_rng_state(i) for i in indices]


def run_with_rng(fn: Callable[[], Any], cpu_state: torch.Tensor,
                 device_state: tuple[str | None, list[int], list[torch.Tensor]]) -> Any:
    """Run ``fn`` from the given RNG states; every RNG state is restored afterwards."""
    device_type, indices, states = device_state
    with torch.random.fork_rng(devices=indices, device_type=device_type or "cuda"):
        torch.set_rng_state(cpu_state)
        if device_type is not None:
            module = torch.get_device_module(device_type)
            for index, state in zip(indices, states):
                module.set_rng_state(state, index)
        return fn()


def chain_tensors(*values: Any) -> Iterator[torch.Tensor]:
    """Every tensor in several nested values."""
    return itertools.chain.from_iterable(flat_tensors(v) for v in values)


def shallow_shadow(module: torch.nn.Module, mode: str,
                   copy_module: Callable[[torch.nn.Module], torch.nn.Module] = copy.copy) -> torch.nn.Module:
    """A hook-free copy of ``module`` built without ``copy.deepcopy`` (Megatron modules hold process
    groups and configs that cannot be deep-copied).

    Each module of the tree is a new object sharing the original's plain attributes (configs, groups);
    it has its own parameter, buffer and submodule dicts: parameters shared or converted as in
    :func:`shadow_module`, buffers copied, submodules copied the same way, no hooks. ``copy_module``
    makes the shallow copy of one module (FSDP2 passes one that drops its ``FSDP<Class>`` classes).
    """
    def convert(t: torch.Tensor) -> torch.Tensor:
        perturbed = mode == "to_cpu" or (mode == "improve_precision" and t.dtype in LOW_PRECISION)
        out = perturb_tensor(t, mode) if perturbed else t.detach().clone()
        return out.clone() if out.data_ptr() == t.data_ptr() else out

    def copy_tree(original: torch.nn.Module, seen: dict[int, torch.nn.Module]) -> torch.nn.Module:
        if id(original) in seen:
            return seen[id(original)]
        shadow = copy_module(original)
        seen[id(original)] = shadow
        params: dict[str, torch.nn.Parameter | None] = {}
        for name, param in original._parameters.items():
            if param is None:
                params[name] = None
                continue
            changed = mode == "to_cpu" or (mode == "improve_precision" and param.dtype in LOW_PRECISION)
            params[name] = torch.nn.Parameter(convert(param), requires_grad=False) if changed else param
        shadow.__dict__["_parameters"] = params
        shadow.__dict__["_buffers"] = {name: None if b is None else convert(b) for name, b in original._buffers.items()}
        shadow.__dict__["_modules"] = {name: None if m is None else copy_tree(m, seen)
                                       for name, m in original._modules.items()}
        for attr in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                     "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
                     "_backward_pre_hooks"):
            if attr in original.__dict__:
                shadow.__dict__[attr] = type(original.__dict__[attr])()
        return shadow

    return copy_tree(module, {})


class CollectiveInRerun(RuntimeError):
    """A re-run tried to communicate: only this rank re-runs, so the collective would never complete."""


# TorchDispatchMode is unannotated (its __init_subclass__ and __init__): the two untyped calls are ignored.
class _RefuseCollectives(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if getattr(func, "namespace", "") == "c10d":
            raise CollectiveInRerun(f"the forward runs the collective {func}")
        return func(*args, **(kwargs or {}))


class RerunOps(Protocol):
    """What the free benchmark needs from a framework to re-run a module and compare its outputs."""

    @property
    def tensor_type(self) -> type:
        """The framework's tensor class (read only: each implementation names its own)."""
        ...

    def save_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]: ...
    def shadow(self, module: Any, mode: str) -> Any: ...
    def rerun(self, shadow: Any, saved: tuple[Any, Any, Any], mode: str, output: Any) -> Any: ...
    def flat_tensors(self, value: Any) -> Iterator[Any]: ...
    def replace_tensors(self, value: Any, new: Iterator[Any]) -> Any: ...
    def ratio_limit(self, tensor: Any) -> float | None: ...
    def max_ratio(self, original: Any, perturbed: Any) -> Any: ...
    def straight_through(self, original: Any, better: Any) -> Any: ...
    def is_floating(self, tensor: Any) -> bool: ...
    def describe(self, tensor: Any) -> tuple[str, tuple[int, ...]]: ...
    def to_host(self, values: list[Any]) -> list[float]: ...


class TorchRerunOps:
    """The torch re-run: a hook-free shadow, ``no_grad``, the RNG states of the original forward.

    Args:
        megatron: also restore Megatron's tensor-parallel RNG tracker (dropout inside
            ``get_cuda_rng_tracker().fork()``) around the re-run.
    """

    tensor_type = torch.Tensor

    def __init__(self, megatron: bool = False) -> None:
        self.megatron = megatron

    def save_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        """Copies of the inputs (the forward may modify them in place) and the RNG states before the forward."""
        tensors = list(chain_tensors(args, kwargs))
        saved_args = replace_tensors(args, iter([t.detach().clone() for t in flat_tensors(args)]))
        saved_kwargs = replace_tensors(kwargs, iter([t.detach().clone() for t in flat_tensors(kwargs)]))
        rng = (torch.get_rng_state(), device_rng_states(iter(tensors)), _tracker_states())
        return rng, saved_args, saved_kwargs

    def shadow(self, module: torch.nn.Module, mode: str) -> torch.nn.Module:
        try:
            return shadow_module(module, mode)
        except Exception:  # e.g. a process group attribute: copy the tree without deepcopy
            return shallow_shadow(module, mode)

    def rerun(self, shadow: torch.nn.Module, saved: tuple[Any, Any, Any], mode: str, output: Any) -> Any:
        (cpu_state, device_state, tracker), saved_args, saved_kwargs = saved
        autocast = _no_autocast(output) if converts_precision(mode) else nullcontext()

        def run() -> Any:
            with torch.no_grad(), autocast, _refuse_collectives(), _tracker_restored(tracker):
                return shadow(*perturb_value(saved_args, mode), **perturb_value(saved_kwargs, mode))

        return run_with_rng(run, cpu_state, device_state)

    def flat_tensors(self, value: Any) -> Iterator[torch.Tensor]:
        return flat_tensors(value)

    def replace_tensors(self, value: Any, new: Iterator[torch.Tensor]) -> Any:
        return replace_tensors(value, new)

    def ratio_limit(self, tensor: torch.Tensor) -> float | None:
        return RATIO_LIMIT.get(tensor.dtype)

    def max_ratio(self, original: torch.Tensor, perturbed: torch.Tensor) -> torch.Tensor:
        return max_ratio(original, perturbed)

    def straight_through(self, original: torch.Tensor, better: torch.Tensor) -> torch.Tensor:
        return straight_through(original, better)

    def is_floating(self, tensor: torch.Tensor) -> bool:
        return tensor.is_floating_point()

    def describe(self, tensor: torch.Tensor) -> tuple[str, tuple[int, ...]]:
        return str(tensor.dtype), tuple(tensor.shape)

    def to_host(self, values: list[torch.Tensor]) -> list[float]:
        stacked = torch.stack([v.to(torch.float64 if v.device.type in ("cpu", "cuda") else torch.float32).to("cpu")
                               for v in values])
        return stacked.tolist()  # sync: one transfer per checked step


def _no_autocast(output: Any) -> AbstractContextManager[Any]:
    tensors = list(flat_tensors(output))
    device_type = tensors[0].device.type if tensors else "cpu"
    return torch.autocast(device_type=device_type, enabled=False)


def _refuse_collectives() -> AbstractContextManager[Any]:
    """In a multi-rank job, a collective in a re-run raises :class:`CollectiveInRerun` before it is sent."""
    if process_groups.world_size() > 1:
        return _RefuseCollectives()  # type: ignore[no-untyped-call]
    return nullcontext()


def _tracker_states() -> dict[str, Any] | None:
    """Megatron's tensor-parallel RNG tracker states (a shallow copy), when it is initialised."""
    module = sys.modules.get("megatron.core.tensor_parallel.random")
    tracker = getattr(module, "_CUDA_RNG_STATE_TRACKER", None) if module is not None else None
    if tracker is None or not hasattr(tracker, "get_states") or not getattr(tracker, "is_initialized", lambda: 0)():
        return None
    return dict(tracker.get_states())


@contextmanager
def _tracker_restored(saved: dict[str, Any] | None) -> Iterator[None]:
    """Run from the tracker states the original forward started from; put the current ones back after."""
    if saved is None:
        yield
        return
    tracker = sys.modules["megatron.core.tensor_parallel.random"]._CUDA_RNG_STATE_TRACKER
    current = dict(tracker.get_states())
    tracker.set_states(dict(saved))
    try:
        yield
    finally:
        tracker.set_states(current)
