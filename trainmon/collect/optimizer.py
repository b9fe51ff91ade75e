"""Weight gradients, parameters and optimizer states of a plain torch optimizer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from trainmon.collect import kernels
from trainmon.collect.hooks import HookRegistry
from trainmon.collect.kernels import ratio_into as _ratio_into
from trainmon.collect.kernels import update_into as _update_into
from trainmon.collect.stats import StatsSpec, fused_kernel, numpy_viewable, partials_torch
from trainmon.steps import scale_of
from trainmon.records import PARTIAL_SLOTS, RowKey

if TYPE_CHECKING:
    from trainmon.collect.context import StepContext
    from trainmon.config import MonitorConfig

_GRADS = "weight_grads"
_OPTIMIZER = "optimizer_step"


def adam_update(state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor | None:
    """The bias-corrected Adam update ``m_hat / (sqrt(v_hat) + eps)`` of one parameter.

    Returns None when ``state`` is not Adam-like. Bias corrections are computed in float64
    on the step counter's device (a CPU tensor in torch's Adam), as torch's Adam does, so
    reading them needs no host synchronisation.
    """
    exp_avg, exp_avg_sq = state.get("exp_avg"), state.get("exp_avg_sq")
    step = state.get("step")
    if exp_avg is None or exp_avg_sq is None or step is None:
        return None
    exp_avg_sq = state.get("max_exp_avg_sq", exp_avg_sq) if group.get("amsgrad") else exp_avg_sq
    beta1, beta2 = group.get("betas", (0.9, 0.999))
    eps = group.get("eps", 1e-8)
    on_cpu = exp_avg.device.type == "cpu" and exp_avg.dtype == exp_avg_sq.dtype == torch.float32
    if on_cpu and (not isinstance(step, torch.Tensor) or step.device.type == "cpu"):
        return _adam_update_cpu(exp_avg, exp_avg_sq, step, beta1, beta2, eps)
    if isinstance(step, torch.Tensor):
        step = step.to(torch.float64 if step.device.type in ("cpu", "cuda") else torch.float32)
        bias1, bias2 = 1 - torch.pow(beta1, step), 1 - torch.pow(beta2, step)
    else:
        bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
    denom = (exp_avg_sq / bias2).sqrt_().add_(eps)
    return (exp_avg / bias1).div_(denom)


def _adam_update_cpu(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: Any, beta1: float, beta2: float,
                     eps: float) -> torch.Tensor:
    """CPU float32: numpy's SIMD loops on views (3-4x faster than torch's CPU kernels), one allocation."""
    update = torch.empty_like(exp_avg)
    constants = _adam_constants(step, beta1, beta2, eps)
    _update_into(exp_avg.numpy(), exp_avg_sq.numpy(), update.numpy(), *constants)  # CPU views: no sync
    return update


def _adam_constants(step: Any, beta1: float, beta2: float, eps: float) -> tuple[float, float]:
    """``(scale, eps')`` with m̂/(√v̂+eps) = m·scale / (√v + eps'): scale = √b2/b1, eps' = eps·√b2."""
    count = float(step.numpy()) if isinstance(step, torch.Tensor) else float(step)  # CPU view: no sync
    root_bias2 = float(np.sqrt(1 - beta2 ** count))
    return root_bias2 / (1 - beta1 ** count), eps * root_bias2


_CHUNK = kernels.CHUNK
"""Elements per chunk of the CPU kernels (:mod:`trainmon.collect.kernels`)."""


def adam_partials_cpu(state: dict[str, Any], group: dict[str, Any], param: torch.Tensor,
                      update_spec: StatsSpec | None, ratio_spec: StatsSpec | None
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """Partial statistics of ``update`` and ``ratio`` for one CPU parameter, chunk by chunk.

    The same values as :func:`adam_update` and :func:`update_ratio` (same arithmetic, in float32),
    but neither full-size tensor is ever allocated: each chunk of the update and of the ratio is
    computed into a cache-resident buffer, measured there, and the chunk partials are combined.
    None when the state is not Adam's (or has a step counter on another device).
    """
    items = _adam_items([(param, state, group)])
    if not items or param.device.type != "cpu":
        return None
    (m, v, _, scale, eps), = items
    rows = np.zeros((2, PARTIAL_SLOTS), np.float32)
    kernels.adam_partial_into(m, v, param if ratio_spec is not None else None, float(scale), float(eps),
                              update_spec, ratio_spec, rows[0], rows[1])
    return (None if update_spec is None else torch.from_numpy(rows[0]),
            None if ratio_spec is None else torch.from_numpy(rows[1]))


def _adam_items(entries: Sequence[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]]
                ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, Any]]:
    """``(m, v, param, scale, eps')`` with update = m * scale / (sqrt(v) + eps'), for Adam-like states.

    ``scale`` and ``eps'`` are host floats where the step counter is a number or a CPU tensor
    (torch's Adam: the counters are read together, one CPU op, no sync), else 0-d tensors on the
    counter's device. Entries whose state is not Adam's are left out.
    """
    adam = [(param, state, group) for param, state, group in entries
            if state.get("exp_avg") is not None and state.get("exp_avg_sq") is not None
            and state.get("step") is not None]
    on_host = [isinstance(state["step"], torch.Tensor) and state["step"].device.type == "cpu"
               for _, state, _ in adam]
    host_steps = [state["step"] for (_, state, _), host in zip(adam, on_host) if host]
    counts = iter(torch.stack(host_steps).to(torch.float64).numpy().tolist() if host_steps else [])  # CPU: no sync
    items = []
    for (param, state, group), host in zip(adam, on_host):
        exp_avg, exp_avg_sq, step = state["exp_avg"], state["exp_avg_sq"], state["step"]
        if group.get("amsgrad") and state.get("max_exp_avg_sq") is not None:
            exp_avg_sq = state["max_exp_avg_sq"]
        beta1, beta2 = group.get("betas", (0.9, 0.999))
        eps = group.get("eps", 1e-8)
        if host or not isinstance(step, torch.Tensor):
            scale, eps = _adam_constants(next(counts) if host else step, beta1, beta2, eps)
        else:  # a step counter on the device (capturable or fused Adam): constants stay there
            count = step.to(torch.float64 if step.device.type == "cuda" else torch.float32)
            root_bias2 = (1 - torch.pow(beta2, count)).sqrt()
            scale, eps = root_bias2 / (1 - torch.pow(beta1, count)), root_bias2 * eps
        items.append((exp_avg, exp_avg_sq, param, scale, eps))
    return items


_TEMPORARY_ELEMENTS = 1 << 22
"""Plain torch fallback: elements of update (and ratio) temporaries alive at once (16 MiB each in float32)."""


def adam_partials_many(entries: Sequence[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]],
                       update_spec: StatsSpec | None, ratio_spec: StatsSpec | None
                       ) -> tuple[list[int], list[tuple[list[int], torch.Tensor, torch.Tensor]]]:
    """Partials of the Adam ``update`` and ``ratio`` of many parameters, without full-size temporaries.

    Args:
        entries: ``(param, state, param_group)`` per parameter.

    Returns:
        ``(adam, blocks)``: the indices of the entries whose state is Adam's, and per group of
        them (same device and dtypes) ``(indices, update_block, ratio_block)``, flat ``[8 k]``
        float32 on the device (a block of zeros where its spec is None). A fused kernel reads
        ``m``, ``v`` (and the parameter) once per group; the plain torch fallback computes the
        update in float32 chunks of bounded size. Never synchronises with the host.
    """
    items = _adam_items(entries)
    adam = [i for i, (_, state, _) in enumerate(entries)
            if state.get("exp_avg") is not None and state.get("exp_avg_sq") is not None
            and state.get("step") is not None]  # the entries _adam_items kept
    groups: dict[tuple, list[int]] = {}
    for j, (m, v, p, _, _) in enumerate(items):
        groups.setdefault((m.device, m.dtype, v.dtype, p.dtype, p.device), []).append(j)
    blocks = []
    with torch.no_grad():
        for (device, *_), members in groups.items():
            chosen = [items[j] for j in members]
            fused = None
            if fused_kernel(device) is not None and kernels.adam_kernel_takes([t for item in chosen for t in item[:3]]):
                fused = _adam_fused(chosen, update_spec, ratio_spec, device)
            update, ratio = fused if fused is not None else _adam_torch(chosen, update_spec, ratio_spec, device)
            blocks.append(([adam[j] for j in members], update, ratio))
    return adam, blocks


def _adam_fused(items: list, update_spec: StatsSpec | None, ratio_spec: StatsSpec | None,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One ``trainmon::adam_partials`` for the group: ``m``, ``v`` (and ``p``) read once."""
    scales, epses = [item[3] for item in items], [item[4] for item in items]
    if all(isinstance(x, float) for x in scales + epses):
        coefficients = torch.tensor([scales, epses], dtype=torch.float64).t().contiguous()
        if device.type != "cpu":  # pageable host memory, non-blocking: the device is not waited for
            coefficients = coefficients.to(device, non_blocking=True)
    else:
        coefficients = torch.stack([torch.stack([torch.as_tensor(a, dtype=torch.float64, device=device),
                                                 torch.as_tensor(b, dtype=torch.float64, device=device)])
                                    for a, b in zip(scales, epses)])
    out = kernels.adam_partials([item[0] for item in items], [item[1] for item in items],
                                [item[2] for item in items] if ratio_spec is not None else [],
                                coefficients, update_spec, ratio_spec)
    if out is None:
        return None
    half = PARTIAL_SLOTS * len(items)
    return out[:half], out[half:]


def _adam_torch(items: list, update_spec: StatsSpec | None, ratio_spec: StatsSpec | None,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch ops: float32 update (and ratio) chunks of at most ``_TEMPORARY_ELEMENTS`` at a time."""
    pieces: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, Any, Any]] = []
    for i, (m, v, p, scale, eps) in enumerate(items):
        if m.is_contiguous() and v.is_contiguous() and p.is_contiguous() and m.numel() > _TEMPORARY_ELEMENTS:
            for chunk in zip(m.view(-1).split(_TEMPORARY_ELEMENTS), v.view(-1).split(_TEMPORARY_ELEMENTS),
                             p.view(-1).split(_TEMPORARY_ELEMENTS)):
                pieces.append((i, *chunk, scale, eps))
        else:
            pieces.append((i, m, v, p, scale, eps))
    updates, ratios, owners = [], [], []
    batch_elements = 0
    parts_u: list[torch.Tensor] = []
    parts_r: list[torch.Tensor] = []

    def flush() -> None:
        if updates:
            if update_spec is not None:
                parts_u.append(partials_torch(updates, update_spec))
            if ratio_spec is not None:
                parts_r.append(partials_torch(ratios, ratio_spec))
            updates.clear()
            ratios.clear()

    for i, m, v, p, scale, eps in pieces:
        if batch_elements + m.numel() > _TEMPORARY_ELEMENTS:
            flush()
            batch_elements = 0
        batch_elements += m.numel()
        update = v.to(torch.float32, copy=True).sqrt_().add_(eps)  # the one float32 temporary
        torch.div(m, update, out=update).mul_(scale)
        updates.append(update)
        owners.append(i)
        if ratio_spec is not None:
            ratios.append(torch.div(update, p).masked_fill_(p == 0, 0.0))
    flush()
    n = len(items)
    return (_combine_pieces(parts_u, owners, n, device), _combine_pieces(parts_r, owners, n, device))


def _combine_pieces(parts: list[torch.Tensor], owners: list[int], n: int, device: torch.device) -> torch.Tensor:
    """Flat ``[8 n]`` partials of ``n`` tensors from the flat partials of their pieces (``owners[k]``: piece k's)."""
    if not parts:
        return torch.zeros(PARTIAL_SLOTS * n, dtype=torch.float32, device=device)
    block = torch.cat(parts) if len(parts) > 1 else parts[0]
    if len(owners) == n:  # one piece per tensor, in order
        return block
    from trainmon.collect.stats import combine_partials_torch
    rows = block.view(-1, PARTIAL_SLOTS)
    combined = [combine_partials_torch(rows[[k for k, owner in enumerate(owners) if owner == i]][:, None, :])
                for i in range(n)]
    return torch.cat(combined).view(-1)


def global_grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm over all of ``grads``, as a float32 0-d tensor on the first gradient's device.

    Per-tensor norms accumulate in float32 (``get_total_norm`` would keep a bf16 gradient's
    norm in bf16, 3 significant digits), one fused ``_foreach_norm`` per device and dtype;
    float32/float64 gradients in their own dtype. Never synchronises with the host.

    Example:
        >>> float(global_grad_norm([torch.full((4,), 1.5, dtype=torch.bfloat16), torch.ones(1)]))
        3.1622776985168457
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    device = grads[0].device
    norms: list[torch.Tensor] = []
    for (_, dtype), group in groups.items():
        if dtype in (torch.float16, torch.bfloat16):
            per_tensor = torch._foreach_norm(group, 2, dtype=torch.float32)
        else:  # float32, float64: in their own precision (dtype=float32 would reject float64)
            per_tensor = torch._foreach_norm(group, 2)
        # a device-to-device copy where gradients span devices (as get_total_norm does): no host sync
        norms.extend(norm.to(device=device, dtype=torch.float32) for norm in per_tensor)
    return torch.linalg.vector_norm(torch.stack(norms))


def update_ratio(update: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Elementwise ``update / param``; elements where the parameter is exactly 0 give 0
    (a zero-initialised bias would otherwise report a false Inf)."""
    param = param.detach()
    if param.device.type == "cpu" and update.dtype == param.dtype == torch.float32:
        ratio = torch.empty_like(update)
        _ratio_into(update.numpy(), param.numpy(), ratio.numpy())  # CPU views: no sync
        return ratio
    return torch.where(param != 0, update / param, 0.0)


class TorchOptimizerCollector:
    """``grad_unreduced``, ``grad_reduced``, ``param`` and optimizer-state rows for a torch optimizer.

    - ``grad_unreduced``: ``param.grad`` in its post-accumulate-grad hook, i.e. as accumulated
      on the parameter after each micro-step's backward (before any data-parallel reduction
      outside autograd); written for the last micro-step, or every one with ``per_micro_step``.
    - ``grad_reduced`` and ``param``: in the optimizer's step pre-hook (what the step uses: after
      ``GradScaler.unscale_`` and clipping); with a closure (``optimizer.step(closure)``: LBFGS,
      Lightning), right after the closure's first call, when its backward has run.
    - optimizer states, ``update`` and ``ratio``: in the step post-hook (after the step).
    - scalar ``grad_norm``: the global L2 norm over every optimizer parameter's gradient *before
      clipping*, read at the end of the backward pass (after data-parallel reduction) of the last
      micro-step, divided by the loss scale under a ``GradScaler``.

    Under a ``GradScaler`` (``ctx.scaler``) ``grad_unreduced`` is divided by the loss scale, so
    every gradient row is in the units the optimizer steps with.

    Args:
        ctx: the monitor's step context.
        params: ``(name, parameter, vpp_stage)`` of the target parameters.
        optimizer: the optimizer, or None (then only ``grad_unreduced``).
        config: the monitor config.
        registry: where the hook handles live.
        all_params: parameters counted in ``grad_norm`` (default: every optimizer parameter).
    """

    def __init__(self, ctx: StepContext, params: Sequence[tuple[str, torch.nn.Parameter, int]],
                 optimizer: torch.optim.Optimizer | None, config: MonitorConfig, registry: HookRegistry) -> None:
        self.ctx = ctx
        self.params = list(params)
        self.optimizer = optimizer
        self.config = config
        self.registry = registry
        self._states = [s for s in config.optimizer_states.states if s in ctx.specs]
        self._norm: torch.Tensor | None = None
        self._norm_final = False
        if optimizer is not None:
            ctx.backward_end.append(self._backward_ended)

    def arm(self) -> None:
        if self.registry.count(_GRADS) or self.registry.count(_OPTIMIZER):
            return
        if "grad_unreduced" in self.ctx.specs:
            for name, param, vpp_stage in self.params:
                if param.requires_grad:
                    hook = self._grad_hook(name, vpp_stage)
                    self.registry.add(_GRADS, param.register_post_accumulate_grad_hook(hook))
        if self.optimizer is not None:
            self.registry.add(_OPTIMIZER, self.optimizer.register_step_pre_hook(self._pre_step))
            if self._states:
                self.registry.add(_OPTIMIZER, self.optimizer.register_step_post_hook(self._post_step))

    def disarm(self) -> None:
        self.registry.remove(_GRADS)
        self.registry.remove(_OPTIMIZER)

    def before_transfer(self) -> None:
        if self._norm is not None and self.ctx.collecting:
            self.ctx.buffer.add_scalar("grad_norm", self._norm)
        self._norm, self._norm_final = None, False

    def close(self) -> None:
        self.disarm()
        if self._backward_ended in self.ctx.backward_end:
            self.ctx.backward_end.remove(self._backward_ended)

    def _grad_hook(self, name: str, vpp_stage: int):  # noqa: ANN202 - hook closure
        per_micro_step = self.config.weight_grads.per_micro_step

        def hook(param: torch.Tensor) -> None:
            ctx = self.ctx
            if ctx.collecting and param.grad is not None and (
                    per_micro_step or ctx.micro_step >= ctx.grad_acc_steps - 1):
                ctx.record("grad_unreduced", name, param.grad, vpp_stage, scale=scale_of(ctx.scaler))

        return hook

    def _backward_ended(self) -> None:
        """End of a backward pass: the pre-clip global norm of the gradients as they stand now."""
        ctx = self.ctx
        if self._norm_final or ctx.micro_step < ctx.grad_acc_steps - 1 or self.optimizer is None:
            return
        grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            norm = global_grad_norm(grads)
            scale = scale_of(ctx.scaler)
            self._norm = norm if scale is None else norm / scale.to(norm.device, torch.float32)

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        if not self.ctx.collecting:
            return None
        self.ctx.forget_measured()  # unscale_ rewrote the gradients without bumping their versions
        # torch passes the step's own arguments, the optimizer first: step(self, closure=None)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._measure_step(optimizer)
            return None
        measured = False

        def closure_then_measure(*closure_args: Any, **closure_kwargs: Any) -> Any:
            nonlocal measured
            loss = closure(*closure_args, **closure_kwargs)
            if not measured:  # LBFGS re-evaluates: the step's direction comes from the first call
                measured = True
                self._measure_step(optimizer)
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_measure}
        return (args[0], closure_then_measure, *args[2:]), kwargs

    def _measure_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``grad_reduced``, ``param`` and ``lr`` of the gradients the optimizer steps with.

        Every target parameter is visible here at once: each family is measured with one
        :meth:`StepContext.record_many` (a few kernels per device and dtype), rows in the order
        of the parameters, gradient then parameter.
        """
        ctx = self.ctx
        if not ctx.collecting:
            return
        rows: dict[str, list[tuple[str, torch.Tensor, int]]] = {"grad_reduced": [], "param": []}
        for name, param, vpp_stage in self.params:
            if param.grad is not None:
                rows["grad_reduced"].append((name, param.grad, vpp_stage))
            rows["param"].append((name, param, vpp_stage))
        self._record_interleaved(rows)
        if self._norm is None:  # no backward pass was seen (gradients set by hand): the norm as it stands
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            if grads:
                self._norm = global_grad_norm(grads)
        self._norm_final = True
        for i, group in enumerate(optimizer.param_groups):
            ctx.buffer.add_scalar(f"lr/group{i}", group["lr"])

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Optimizer states, ``update`` and ``ratio`` after the step, each family measured at once."""
        ctx = self.ctx
        if not ctx.collecting:
            return
        group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        rows: dict[str, list[tuple[str, torch.Tensor, int]]] = {
            family: [] for family in ("exp_avg", "exp_avg_sq", "momentum", "update", "ratio")}
        adam_entries: list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]] = []
        adam_rows: list[tuple[str, int]] = []
        derived = "update" in self._states or "ratio" in self._states
        for name, param, vpp_stage in self.params:
            state = optimizer.state.get(param)
            if not state:
                continue
            for family in ("exp_avg", "exp_avg_sq"):
                if family in self._states and family in state:
                    rows[family].append((name, state[family], vpp_stage))
            if "momentum" in self._states and state.get("momentum_buffer") is not None:
                rows["momentum"].append((name, state["momentum_buffer"], vpp_stage))
            if derived and all(state.get(key) is not None for key in ("exp_avg", "exp_avg_sq", "step")):
                # placeholders keep the rows' execution order; the values come from adam_partials_many
                for family in ("update", "ratio"):
                    if family in self._states:
                        rows[family].append((name, param, vpp_stage))
                adam_entries.append((param, state, group_of[id(param)]))
                adam_rows.append((name, vpp_stage))
        orders = self._record_interleaved(rows, skip=("update", "ratio"))
        if adam_entries:
            self._record_adam(adam_entries, adam_rows, orders)

    def _record_interleaved(self, rows: dict[str, list[tuple[str, torch.Tensor, int]]],
                            skip: Sequence[str] = ()) -> dict[str, list[int]]:
        """``record_many`` per family, with execution orders interleaved parameter by parameter
        (as if each parameter's rows were recorded in turn). Returns the orders of every family."""
        ctx = self.ctx
        families = [family for family, entries in rows.items() if entries and family in ctx.specs]
        if not families:
            return {}
        reserve = getattr(ctx.buffer, "reserve_orders", None)
        orders: dict[str, list[int]] = {family: [] for family in families}
        if reserve is not None:
            # one order per row, a parameter's rows consecutive (the rows lists follow self.params)
            names = {family: {entry[0] for entry in rows[family]} for family in families}
            position: dict[tuple[str, str], int] = {}
            next_order = reserve(sum(len(rows[family]) for family in families))
            for name, _, _ in self.params:
                for family in families:
                    if name in names[family]:
                        position[(family, name)] = next_order
                        next_order += 1
            for family in families:
                orders[family] = [position[(family, entry[0])] for entry in rows[family]]
        for family in families:
            if family in skip:
                continue
            entries = rows[family]
            ctx.record_many(family, [e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries],
                            orders=orders[family] or None)
        return orders

    def _record_adam(self, entries: list, names: list[tuple[str, int]], orders: dict[str, list[int]]) -> None:
        """``update`` and ``ratio`` rows of the Adam-like parameters, without full-size temporaries."""
        ctx = self.ctx
        update_spec = ctx.specs.get("update") if "update" in self._states else None
        ratio_spec = ctx.specs.get("ratio") if "ratio" in self._states else None
        if update_spec is None and ratio_spec is None:
            return
        _, blocks = adam_partials_many(entries, update_spec, ratio_spec)
        for family, spec, which in (("update", update_spec, 1), ("ratio", ratio_spec, 2)):
            if spec is None:
                continue
            family_orders = orders.get(family) or None
            for group in blocks:
                indices, block = group[0], group[which]
                keys = [RowKey(family, names[i][0], ctx.micro_step, names[i][1],
                               family_orders[i] if family_orders else ctx.buffer.next_order()) for i in indices]
                ctx.buffer.add_block(keys, block)
