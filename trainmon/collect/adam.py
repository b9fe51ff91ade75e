"""The Adam update ``m_hat / (sqrt(v_hat) + eps)`` and its ratio to the parameter, and their statistics.

The fused kernels measure a group of parameters in one read (:func:`adam_partials_many`); where none takes the
group's tensors, the plain torch ops of :mod:`trainmon.collect.adam_fallback` do.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any, TypeAlias

import numpy as np
import torch

from trainmon.base.partials import PARTIAL_SLOTS
from trainmon.collect import kernels
from trainmon.collect.adam_fallback import AdamItem, Coefficient, adam_partials_torch
from trainmon.collect.kernel_ops import ADAM_PARTS, adam_parts
from trainmon.collect.kernels import ratio_into as _ratio_into
from trainmon.collect.kernels import update_into as _update_into
from trainmon.collect.stats import fused_kernel, numpy_viewable
from trainmon.collect.stats_base import StatsSpec

AdamEntry: TypeAlias = "tuple[torch.Tensor, dict[str, Any], dict[str, Any]]"
"""``(param, state, param_group)`` of one parameter: its optimizer state and its group's settings."""


def adam_update(state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor | None:
    """The bias-corrected Adam update ``m_hat / (sqrt(v_hat) + eps)`` of one parameter.

    Returns None when ``state`` is not Adam-like. Bias corrections are computed in float64
    on the step counter's device (a CPU tensor in torch's Adam), as torch's Adam does, so
    reading them needs no host synchronisation.
    """
    exp_avg: torch.Tensor | None = state.get("exp_avg")
    exp_avg_sq: torch.Tensor | None = state.get("exp_avg_sq")
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


def decay_is_coupled(group: dict[str, Any], optimizer: Any = None) -> bool:
    """Whether ``group``'s weight decay is added to the gradient before the moments (Adam's L2 decay) rather than
    applied to the weights (AdamW): the group's ``decoupled_weight_decay`` (torch >= 2.6), else the optimizer's
    ``adam_w_mode`` (DeepSpeed's and apex's FusedAdam, DeepSpeedCPUAdam), else whether it is torch's ``Adam``.

    Example:
        >>> params = [torch.nn.Parameter(torch.ones(1))]
        >>> adam, adamw = torch.optim.Adam(params, weight_decay=0.1), torch.optim.AdamW(params, weight_decay=0.1)
        >>> decay_is_coupled(adam.param_groups[0], adam), decay_is_coupled(adamw.param_groups[0], adamw)
        (True, False)
    """
    if not group.get("weight_decay"):
        return False
    decoupled = group.get("decoupled_weight_decay")
    if decoupled is not None:
        return not decoupled
    mode = getattr(optimizer, "adam_w_mode", None)
    if mode is not None:
        return not mode
    return isinstance(optimizer, torch.optim.Adam) and not isinstance(optimizer, torch.optim.AdamW)


def coupled_groups(optimizers: Sequence[Any]) -> frozenset[int]:
    """``id`` of every parameter group of ``optimizers`` whose weight decay is coupled (:func:`decay_is_coupled`)."""
    return frozenset(id(group) for optimizer in optimizers for group in getattr(optimizer, "param_groups", ())
                     if decay_is_coupled(group, optimizer))


def _learning_rate(group: dict[str, Any]) -> Coefficient:
    """The group's learning rate: a host float (a CPU tensor is read: no sync), a device tensor as it is, or
    NaN where the group has none (then ``update_weight_ratio`` is NaN)."""
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor):
        return float(lr.detach().numpy()) if lr.device.type == "cpu" else lr.detach()  # CPU: a view, no sync
    return float(lr) if isinstance(lr, (int, float)) else math.nan


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
    (m, v, _, scale, eps, *_), = items
    rows = np.zeros((2, PARTIAL_SLOTS), np.float32)
    kernels.adam_partial_into(m, v, param if ratio_spec is not None else None, float(scale), float(eps),
                              update_spec, ratio_spec, rows[0], rows[1])
    return (None if update_spec is None else torch.from_numpy(rows[0]),
            None if ratio_spec is None else torch.from_numpy(rows[1]))


def _adam_items(entries: Sequence[AdamEntry], coupled: Collection[int] = ()) -> list[AdamItem]:
    """``(m, v, param, scale, eps', lr, 1 - beta2^t, sign, decay)`` with update = m * scale / (sqrt(v) + eps'), for
    Adam-like states.

    ``scale``, ``eps'`` and ``1 - beta2^t`` are host floats where the step counter is a number or a CPU tensor
    (torch's Adam: the counters are read together, one CPU op, no sync), else 0-d tensors on the
    counter's device; ``lr`` as :func:`_learning_rate`. The gradient the moments took is ``sign * grad +
    decay * param_before`` (``sign`` -1 with ``maximize``; ``decay`` the weight decay of a coupled group: one
    whose ``id`` is in ``coupled`` or that :func:`decay_is_coupled` says so from its keys). Entries whose state
    is not Adam's are left out.
    """
    adam = [(param, state, group) for param, state, group in entries
            if state.get("exp_avg") is not None and state.get("exp_avg_sq") is not None
            and state.get("step") is not None]
    on_host = [isinstance(state["step"], torch.Tensor) and state["step"].device.type == "cpu"
               for _, state, _ in adam]
    host_steps = [state["step"] for (_, state, _), host in zip(adam, on_host) if host]
    counts = iter(torch.stack(host_steps).to(torch.float64).numpy().tolist() if host_steps else [])  # CPU: no sync
    items: list[AdamItem] = []
    scale: Coefficient
    eps: Coefficient
    bias2: Coefficient
    for (param, state, group), host in zip(adam, on_host):
        exp_avg, exp_avg_sq, step = state["exp_avg"], state["exp_avg_sq"], state["step"]
        if group.get("amsgrad") and state.get("max_exp_avg_sq") is not None:
            exp_avg_sq = state["max_exp_avg_sq"]
        beta1, beta2 = group.get("betas", (0.9, 0.999))
        group_eps = group.get("eps", 1e-8)
        if host or not isinstance(step, torch.Tensor):
            count = next(counts) if host else float(step)
            scale, eps = _adam_constants(count, beta1, beta2, group_eps)
            bias2 = 1 - beta2 ** count
        else:  # a step counter on the device (capturable or fused Adam): constants stay there
            count_tensor = step.to(torch.float64 if step.device.type == "cuda" else torch.float32)
            bias2 = 1 - torch.pow(beta2, count_tensor)
            root_bias2 = bias2.sqrt()
            scale, eps = root_bias2 / (1 - torch.pow(beta1, count_tensor)), root_bias2 * group_eps
        sign = -1.0 if group.get("maximize") else 1.0
        decay = float(group.get("weight_decay") or 0.0) if id(group) in coupled or decay_is_coupled(group) else 0.0
        items.append((exp_avg, exp_avg_sq, param, scale, eps, _learning_rate(group), bias2, sign, decay))
    return items


AdamBlocks: TypeAlias = ("tuple[list[int], torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None, "
                         "tuple[torch.Tensor, torch.Tensor] | None]")
"""``(indices, update_block, ratio_block, (exp_avg_block, exp_avg_sq_block) or None, (precursor_heads,
precursor_tails) or None)`` of one group."""


def adam_partials_many(entries: Sequence[AdamEntry],
                       update_spec: StatsSpec | None, ratio_spec: StatsSpec | None,
                       state_spec: StatsSpec | None = None, grads: Sequence[torch.Tensor | None] | None = None,
                       coupled: Collection[int] = ()) -> tuple[list[int], list[AdamBlocks]]:
    """Partials of the Adam ``update`` and ``ratio`` of many parameters, without full-size temporaries.

    Args:
        entries: ``(param, state, param_group)`` per parameter.
        state_spec: also the statistics of ``exp_avg`` and ``exp_avg_sq``, from the same read, where a
            fused kernel reads them on the device path (the groups whose ``v`` is ``exp_avg_sq`` itself, not
            AMSGrad's ``max_exp_avg_sq``, and of one dtype with ``m``); None: not wanted.
        grads: per entry, the gradient the step used (None: that parameter has no precursor row): also the
            precursor rows (:mod:`trainmon.base.precursors`), from the same read of ``m``, ``v`` and the
            parameter; None: not wanted.
        coupled: ``id`` of the parameter groups whose weight decay is coupled (:func:`coupled_groups`; only
            needed where the group does not say so itself, before torch 2.6 and in DeepSpeed's FusedAdam): the
            precursors then take the gradient plus the decay, as the moments did.

    Returns:
        ``(adam, blocks)``: the indices of the entries whose state is Adam's, and per group of
        them (same device and dtypes) ``(indices, update_block, ratio_block, states, precursors)``, flat
        ``[8 k]`` float32 on the device (a block of zeros where its spec is None); ``states`` is the
        ``(exp_avg, exp_avg_sq)`` blocks, or None where they were not measured here; ``precursors`` the
        ``(heads, tails)`` blocks of a group whose parameters have gradients, else None. A fused kernel
        reads ``m``, ``v`` (the parameter and the gradient) once per group; the plain torch fallback computes
        the update in float32 chunks of bounded size. Never synchronises with the host.
    """
    items = _adam_items(entries, coupled)
    adam = [i for i, (_, state, _) in enumerate(entries)
            if state.get("exp_avg") is not None and state.get("exp_avg_sq") is not None
            and state.get("step") is not None]  # the entries _adam_items kept
    wanted = [grads[i] if grads is not None and _pairs(grads[i], items[j][0]) else None for j, i in enumerate(adam)]
    groups: dict[tuple[Any, ...], list[int]] = {}
    for j, (m, v, p, *_) in enumerate(items):
        own_v = state_spec is None or v is entries[adam[j]][1]["exp_avg_sq"]  # not AMSGrad's max_exp_avg_sq
        grad = wanted[j]
        grad_key = None if grad is None else (grad.dtype, grad.device, grad.shape == m.shape)
        groups.setdefault((m.device, m.dtype, v.dtype, p.dtype, p.device, own_v, grad_key), []).append(j)
    blocks: list[AdamBlocks] = []
    with torch.no_grad():
        for (device, m_dtype, v_dtype, _, _, own_v, grad_key), members in groups.items():
            chosen = [items[j] for j in members]
            chosen_grads = [g for g in (wanted[j] for j in members) if g is not None] if grad_key else []
            fused = None
            tensors = [t for item in chosen for t in item[:3]] + chosen_grads
            if fused_kernel(device) is not None and kernels.adam_kernel_takes(tensors):
                # on the CPU fast path (float32 numpy views) m and v are cheaper whole than in the chunks
                states = state_spec if own_v and m_dtype == v_dtype and not numpy_viewable(chosen[0][0]) else None
                fused = _adam_fused(chosen, update_spec, ratio_spec, states, device, chosen_grads)
            if fused is None:
                blocks.append(([adam[j] for j in members],
                               *adam_partials_torch(chosen, update_spec, ratio_spec, device, chosen_grads)))
            else:
                blocks.append(([adam[j] for j in members], *fused))
    return adam, blocks


def _pairs(grad: torch.Tensor | None, exp_avg: torch.Tensor) -> bool:
    """Whether ``grad`` can be read with ``exp_avg`` element by element (same device and count)."""
    return grad is not None and grad.device == exp_avg.device and grad.numel() == exp_avg.numel()


def precursor_partials(entries: Sequence[AdamEntry], grads: Sequence[torch.Tensor | None],
                       coupled: Collection[int] = ()) -> list[torch.Tensor | None]:
    """Per entry, its precursor head and tail as a flat ``[16]`` float32 tensor on its device (None where the state
    is not Adam's or the gradient is None): for integrations that measure shards one at a time (DeepSpeed,
    Megatron, FSDP2). The same kernels as :func:`adam_partials_many`; never synchronises with the host.
    """
    adam, blocks = adam_partials_many(entries, None, None, None, grads, coupled)
    out: list[torch.Tensor | None] = [None] * len(entries)
    for indices, _, _, _, precursors in blocks:
        if precursors is None:
            continue
        heads, tails = (block.view(-1, PARTIAL_SLOTS) for block in precursors)
        for k, i in enumerate(indices):
            out[i] = torch.cat([heads[k], tails[k]])
    del adam
    return out


def _adam_fused(items: list[AdamItem], update_spec: StatsSpec | None, ratio_spec: StatsSpec | None,
                state_spec: StatsSpec | None, device: torch.device, grads: list[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None,
                           tuple[torch.Tensor, torch.Tensor] | None] | None:
    """One ``trainmon::adam_partials`` for the group: ``m``, ``v`` (``p``, ``g``) read once."""
    columns = [[item[k] for item in items] for k in range(3, 9)]  # scale, eps', lr, 1 - beta2^t, sign, decay
    if all(isinstance(x, float) for column in columns for x in column):
        coefficients = torch.tensor(columns, dtype=torch.float64).t().contiguous()
        if device.type != "cpu":  # pageable host memory, non-blocking: the device is not waited for
            coefficients = coefficients.to(device, non_blocking=True)
    else:
        coefficients = torch.stack([torch.stack([torch.as_tensor(x, dtype=torch.float64, device=device)
                                                 for x in row]) for row in zip(*columns)])
    read_params = ratio_spec is not None or bool(grads)
    out = kernels.adam_partials([item[0] for item in items], [item[1] for item in items],
                                [item[2] for item in items] if read_params else [],
                                coefficients, update_spec, ratio_spec, state_spec, grads)
    if out is None:
        return None
    parts = out.view(adam_parts(grads), -1).unbind()
    update, ratio, m, v = parts[:ADAM_PARTS]
    return (update, ratio, (m, v) if state_spec is not None else None,
            (parts[ADAM_PARTS], parts[ADAM_PARTS + 1]) if grads else None)



def update_ratio(update: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Elementwise ``update / param``; elements where the parameter is exactly 0 give 0
    (a zero-initialised bias would otherwise report a false Inf)."""
    param = param.detach()
    if param.device.type == "cpu" and update.dtype == param.dtype == torch.float32:
        ratio = torch.empty_like(update)
        _ratio_into(update.numpy(), param.numpy(), ratio.numpy())  # CPU views: no sync
        return ratio
    return torch.where(param != 0, update / param, 0.0)
