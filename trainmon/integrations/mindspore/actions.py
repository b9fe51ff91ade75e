"""MindSpore (PyNative) side of the anomaly actions: dump, free benchmark and the non-finite localiser.

:class:`MindSporeFramework` gives the shared actions (:mod:`trainmon.actions`) MindSpore's cell
hooks and tensors, and writes msprobe's MindSpore dump layout: keys ``Cell.{name}.{Class}.forward.{n}``,
tensors described as ``{"type": "mindspore.Tensor", "dtype": "Float32", "shape", "Max", "Min", "Mean",
"Norm"}``, tensor files saved with ``numpy.save`` (``.npy``). Statistics stay on the device until the
step's one host copy. Backward entries come from ``Cell.register_backward_hook`` (``input``: the
gradients w.r.t. the cell's outputs, ``output``: w.r.t. its inputs), parameter gradients from
``Parameter.register_hook`` (the gradient of the micro-step; MindSpore accumulates none).

:class:`MindSporeRerunOps` re-runs a cell for the free benchmark: a hook-free deep copy whose trainable
parameters are shared (or converted to a higher precision) and whose other parameters (batch-norm
moving statistics) are copies, under ``mindspore._no_grad()``, from the global RNG state the original
forward started from (``mint`` dropout draws the same mask); every state is restored afterwards.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

import mindspore as ms
import numpy as np
import numpy.typing as npt
from mindspore import Parameter, Tensor, mint, ops

_F32 = ms.float32
_LOW = (ms.float16, ms.bfloat16)
_HIGHER = {ms.float16: ms.float32, ms.bfloat16: ms.float32, ms.float32: ms.float64, ms.float64: ms.float64}
_INT_OF_SIZE = {2: ms.int16, 4: ms.int32, 8: ms.int64}
NOISE = {ms.bfloat16: 1e-4, ms.float16: 1e-6, ms.float32: 1e-8, ms.float64: 1e-16}
RATIO_LIMIT = {ms.float16: 1.002, ms.bfloat16: 1.004, ms.float32: 1.0002, ms.float64: 1.0002}
_TINY = {ms.float16: 6.104e-05, ms.bfloat16: 1.1755e-38, ms.float32: 1.1755e-38, ms.float64: 2.2251e-308}


def _floating(tensor: Tensor) -> bool:
    return tensor.dtype in (ms.float16, ms.bfloat16, ms.float32, ms.float64)


class MindSporeFramework:
    """Cell hooks and MindSpore tensors for the dump, the free benchmark and the localiser."""

    name = "mindspore"
    module_prefix = "Cell"
    file_suffix = ".npy"
    tensor_type = Tensor
    tensor_gradients = False
    megatron = False

    def __init__(self) -> None:
        self.wrap: Callable[[Callable[..., Any]], Callable[..., Any]] = lambda hook: hook
        """Applied to every hook before it is registered: the session puts the action's fail-safe guard here."""

    # ------------------------------------------------------------------ module tree and hooks
    def named_modules(self, root: Any) -> Iterable[tuple[str, Any]]:
        cells: Iterable[tuple[str, Any]] = root.cells_and_names()
        return cells

    def children(self, cell: Any) -> Iterable[tuple[str, Any]]:
        children: Iterable[tuple[str, Any]] = cell.name_cells().items()
        return children

    def unwrap(self, chunk: Any) -> Any:
        return chunk

    def own_parameters(self, cell: Any) -> list[tuple[str, Parameter]]:
        # msprobe's naming: the parameter's own name without its cell prefix
        return [(key.split(".")[-1], param) for key, param in cell.parameters_dict(recurse=False).items()]

    def class_name(self, cell: Any) -> str:
        return type(cell).__name__

    def forward_pre_hook(self, cell: Any, hook: Callable[..., Any]) -> Any:
        return cell.register_forward_pre_hook(self.wrap(hook), with_kwargs=True)

    def forward_hook(self, cell: Any, hook: Callable[..., Any]) -> Any:
        return cell.register_forward_hook(self.wrap(hook), with_kwargs=True)

    def backward_hook(self, cell: Any, hook: Callable[..., Any]) -> Any:
        return cell.register_backward_hook(self.wrap(hook))

    def tensor_hook(self, tensor: Tensor, hook: Callable[..., Any]) -> Any:
        raise NotImplementedError("MindSpore backward entries come from cell backward hooks")

    def param_grad_hook(self, param: Parameter, hook: Callable[[Tensor], Any]) -> Any:
        def on_gradient(grad: Tensor) -> None:
            hook(grad)

        return param.register_hook(self.wrap(on_gradient))

    def grad_enabled(self) -> bool:
        return True

    def is_rerun(self) -> bool:
        return False

    # ------------------------------------------------------------------ tensors
    def describe_tensor(self, tensor: Tensor) -> dict[str, Any]:
        return {"type": "mindspore.Tensor", "dtype": str(tensor.dtype), "shape": list(tensor.shape),
                "Max": None, "Min": None, "Mean": None, "Norm": None}

    def describe_other(self, value: Any) -> dict[str, Any] | None:
        if isinstance(value, ms.dtype.Type):
            return {"type": "mindspore.dtype", "value": str(value)}
        if isinstance(value, slice):
            return {"type": "slice", "value": str(value)}
        return None

    def statistics(self, tensor: Tensor) -> Tensor | None:
        """``[Max, Min, Mean, Norm]`` on the device in float32 (float64 tensors in float64); a NaN makes
        Max and Min NaN (MindSpore's CPU min/max skip NaN, torch's and msprobe's do not)."""
        if int(tensor.size) == 0:
            return None
        x = tensor.reshape(-1)
        acc = ms.float64 if x.dtype == ms.float64 else _F32
        if x.dtype != acc:
            x = x.astype(acc)
        squares = mint.sum(x * x)
        nan = Tensor(float("nan"), acc)
        has_nan = mint.isnan(squares)
        hi = ops.select(has_nan, nan, mint.max(x))
        lo = ops.select(has_nan, nan, mint.min(x))
        return ops.stack([hi, lo, mint.mean(x), mint.sqrt(squares)])

    def extremes(self, tensor: Tensor) -> Tensor | None:
        """A ``[2]`` float32 tensor that is non-finite exactly when ``tensor`` holds a NaN or an Inf."""
        if int(tensor.size) == 0 or not _floating(tensor):
            return None
        if tensor.dtype == ms.bfloat16:  # MindSpore's CPU kernels take no bfloat16
            tensor = tensor.astype(_F32)
        bad = mint.logical_not(mint.isfinite(tensor)).any()
        flag = ops.select(bad, Tensor(float("nan"), _F32), Tensor(0.0, _F32))
        return ops.stack([flag, flag])

    def nonfinite_rows(self, extremes: list[Tensor]) -> list[bool]:
        if not extremes:
            return []
        flags = mint.logical_not(mint.isfinite(ops.stack(extremes)).all(axis=1))
        return [bool(flag) for flag in flags.asnumpy()]  # sync: the localiser's one transfer per step

    def to_host(self, stats: list[Tensor]) -> list[list[float]]:
        if not stats:
            return []
        stacked = ops.stack([s.astype(ms.float64) for s in stats])
        values: list[list[float]] = stacked.asnumpy().tolist()  # sync: the one statistics transfer of a dump step
        return values

    def nbytes(self, tensor: Tensor) -> int:
        return int(tensor.nbytes)

    def host_copy(self, tensor: Tensor) -> npt.NDArray[Any]:
        if tensor.dtype == ms.bfloat16:  # numpy has no bfloat16 (msprobe saves these as float32 too)
            tensor = tensor.astype(_F32)
        host: npt.NDArray[Any] = tensor.asnumpy().copy()  # sync: the dump's host copy (dump steps only)
        return host

    def save(self, host: npt.NDArray[Any], handle: IO[bytes]) -> None:
        np.save(handle, host, allow_pickle=False)

    def host_bytes(self, host: npt.NDArray[Any]) -> bytes:
        return np.ascontiguousarray(host).tobytes()

    def rerun_ops(self) -> MindSporeRerunOps:
        return MindSporeRerunOps()


# ---------------------------------------------------------------------------------- free benchmark
def perturb_tensor(x: Tensor, mode: str) -> Tensor:
    """A perturbed copy of one MindSpore input tensor (the torch semantics of :mod:`trainmon.actions.perturb`)."""
    if mode == "to_cpu":
        moved = x.move_to("CPU") if hasattr(x, "move_to") else x
        return moved.astype(_HIGHER[x.dtype]) if _floating(x) else moved
    if not _floating(x) or mode == "no_change":
        return x
    if x.dtype == ms.bfloat16 and mode in ("add_noise", "change_value"):  # no bfloat16 CPU kernels: via float32
        return perturb_tensor(x.astype(_F32), mode).astype(ms.bfloat16)
    if mode == "improve_precision":
        return x.astype(_F32) if x.dtype in _LOW else x
    if mode == "add_noise":
        eps = NOISE[x.dtype]
        return ops.select(mint.abs(x) > eps ** 0.5, x + Tensor(eps, x.dtype), x)
    if mode == "bit_noise":
        int_type = _INT_OF_SIZE[x.itemsize]
        flipped = (x.view(int_type) ^ 1).view(x.dtype)
        mask = mint.logical_and(mint.isfinite(x), mint.abs(x) > _TINY[x.dtype])
        return ops.select(mask, flipped, x)
    if mode == "change_value":
        flat = x.reshape(-1).copy()
        if flat.shape[0] >= 2:
            first, last = flat[0].copy(), flat[-1].copy()
            flat[0] = last
            flat[-1] = first
        return flat.reshape(x.shape)
    raise ValueError(f"unknown perturbation {mode!r}")


def _map(value: Any, fn: Callable[[Tensor], Any]) -> Any:
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map(v, fn) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _map(v, fn)) for k, v in value.items())
    return value


def flat_tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from flat_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from flat_tensors(item)


def shadow_cell(cell: Any, mode: str) -> Any:
    """A hook-free deep copy of ``cell``: trainable parameters shared (converted for ``improve_precision``
    and ``to_cpu``), other parameters (moving statistics) copied, hook containers empty."""
    memo: dict[int, Any] = {}
    for _, sub in cell.cells_and_names():
        for attr, value in vars(sub).items():
            if "hook" not in attr or value is None or isinstance(value, (bool, int, float, str)):
                continue
            memo[id(value)] = type(value)() if isinstance(value, (dict, list, set)) else None
    for param in cell.get_parameters():
        changed = mode == "to_cpu" or (mode == "improve_precision" and param.dtype in _LOW)
        if param.requires_grad and not changed:
            memo[id(param)] = param
        else:
            data = perturb_tensor(param, mode) if changed else param.copy()
            memo[id(param)] = Parameter(data, name=param.name, requires_grad=False)
    return copy.deepcopy(cell, memo)


class MindSporeRerunOps:
    """The MindSpore re-run and comparison for :class:`~trainmon.actions.free_benchmark.FreeBenchmark`."""

    tensor_type = Tensor

    def save_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        return ms.get_rng_state(), _map(args, lambda t: t.copy()), _map(kwargs, lambda t: t.copy())

    def shadow(self, cell: Any, mode: str) -> Any:
        return shadow_cell(cell, mode)

    def rerun(self, shadow: Any, saved: tuple[Any, Any, Any], mode: str, output: Any) -> Any:
        state, args, kwargs = saved
        current = ms.get_rng_state()
        ms.set_rng_state(state)
        try:
            with ms._no_grad():
                return shadow(*_map(args, lambda t: perturb_tensor(t, mode)),
                              **_map(kwargs, lambda t: perturb_tensor(t, mode)))
        finally:
            ms.set_rng_state(current)

    def flat_tensors(self, value: Any) -> Iterator[Tensor]:
        return flat_tensors(value)

    def replace_tensors(self, value: Any, new: Iterator[Tensor]) -> Any:
        return _map(value, lambda _: next(new))

    def ratio_limit(self, tensor: Tensor) -> float | None:
        return RATIO_LIMIT.get(tensor.dtype)

    def max_ratio(self, original: Tensor, perturbed: Tensor) -> Tensor:
        """msprobe's criterion on the device, in float64 (as the torch version on CPU)."""
        acc = ms.float64
        if tuple(original.shape) != tuple(perturbed.shape):
            return Tensor(float("inf"), acc)
        if int(original.size) == 0:
            return Tensor(1.0, acc)
        tol = NOISE.get(original.dtype, NOISE[ms.float32]) ** 0.5
        o, p = original.astype(acc), perturbed.astype(acc)
        a, b = mint.abs(o), mint.abs(p)
        big = mint.maximum(a, b)
        ratio = big / mint.clamp(mint.minimum(a, b), min=tol)
        one, inf = ops.ones_like(ratio), ops.full_like(ratio, float("inf"))
        ratio = ops.select(big <= tol, one, ratio)
        ratio = ops.select(mint.logical_and(o * p < 0, big > tol), inf, ratio)
        same = mint.logical_or(mint.logical_and(mint.isnan(o), mint.isnan(p)), o == p)
        finite = mint.logical_and(mint.isfinite(o), mint.isfinite(p))
        ratio = ops.select(finite, ratio, ops.select(same, one, inf))
        # MindSpore's CPU max skips NaN; a NaN ratio (NaN on one side only is inf above) cannot occur
        return mint.max(ratio)

    def straight_through(self, original: Tensor, better: Tensor) -> Tensor:
        reference = original.astype(_F32)
        delta = ops.stop_gradient(better.astype(_F32) - reference)
        return (reference + delta).astype(original.dtype)

    def is_floating(self, tensor: Tensor) -> bool:
        return _floating(tensor)

    def describe(self, tensor: Tensor) -> tuple[str, tuple[int, ...]]:
        return str(tensor.dtype), tuple(tensor.shape)

    def to_host(self, values: list[Tensor]) -> list[float]:
        return [float(v) for v in ops.stack([v.astype(ms.float64) for v in values]).asnumpy()]  # sync: one per step
