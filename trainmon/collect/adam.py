"""The Adam update ``m_hat / (sqrt(v_hat) + eps)`` and its ratio to the parameter, and their statistics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias, TypeGuard

import numpy as np
import torch

from trainmon.base.records import PARTIAL_SLOTS
from trainmon.collect import kernels
from trainmon.collect.fallback import bounded_batches
from trainmon.collect.kernels import ratio_into as _ratio_into
from trainmon.collect.kernels import update_into as _update_into
from trainmon.collect.stats import combine_partials_torch, fused_kernel, numpy_viewable, partials_torch
from trainmon.collect.stats_base import StatsSpec

AdamEntry: TypeAlias = "tuple[torch.Tensor, dict[str, Any], dict[str, Any]]"
"""``(param, state, param_group)`` of one parameter: its optimizer state and its group's settings."""
Coefficient: TypeAlias = "float | torch.Tensor"
"""A constant of the update: a host float, or a 0-d tensor on the step counter's device (capturable Adam)."""
_Item: TypeAlias = "tuple[torch.Tensor, torch.Tensor, torch.Tensor, Coefficient, Coefficient]"
"""``(m, v, param, scale, eps')`` of one parameter (:func:`_adam_items`)."""
_Piece: TypeAlias = "tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, Coefficient, Coefficient]"
"""``(owner, m, v, param, scale, eps')``: a whole parameter or a contiguous chunk of parameter ``owner``."""


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


def _adam_items(entries: Sequence[AdamEntry]) -> list[_Item]:
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
    items: list[_Item] = []
    scale: Coefficient
    eps: Coefficient
    for (param, state, group), host in zip(adam, on_host):
        exp_avg, exp_avg_sq, step = state["exp_avg"], state["exp_avg_sq"], state["step"]
        if group.get("amsgrad") and state.get("max_exp_avg_sq") is not None:
            exp_avg_sq = state["max_exp_avg_sq"]
        beta1, beta2 = group.get("betas", (0.9, 0.999))
        group_eps = group.get("eps", 1e-8)
        if host or not isinstance(step, torch.Tensor):
            scale, eps = _adam_constants(next(counts) if host else step, beta1, beta2, group_eps)
        else:  # a step counter on the device (capturable or fused Adam): constants stay there
            count = step.to(torch.float64 if step.device.type == "cuda" else torch.float32)
            root_bias2 = (1 - torch.pow(beta2, count)).sqrt()
            scale, eps = root_bias2 / (1 - torch.pow(beta1, count)), root_bias2 * group_eps
        items.append((exp_avg, exp_avg_sq, param, scale, eps))
    return items


_TEMPORARY_ELEMENTS = 1 << 22
"""Plain torch fallback: elements of update (and ratio) temporaries alive at once (16 MiB each in float32)."""


AdamBlocks: TypeAlias = "tuple[list[int], torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]"
"""``(indices, update_block, ratio_block, (exp_avg_block, exp_avg_sq_block) or None)`` of one group."""


def adam_partials_many(entries: Sequence[AdamEntry],
                       update_spec: StatsSpec | None, ratio_spec: StatsSpec | None,
                       state_spec: StatsSpec | None = None) -> tuple[list[int], list[AdamBlocks]]:
    """Partials of the Adam ``update`` and ``ratio`` of many parameters, without full-size temporaries.

    Args:
        entries: ``(param, state, param_group)`` per parameter.
        state_spec: also the statistics of ``exp_avg`` and ``exp_avg_sq``, from the same read, where a
            fused kernel reads them on the device path (the groups whose ``v`` is ``exp_avg_sq`` itself, not
            AMSGrad's ``max_exp_avg_sq``, and of one dtype with ``m``); None: not wanted.

    Returns:
        ``(adam, blocks)``: the indices of the entries whose state is Adam's, and per group of
        them (same device and dtypes) ``(indices, update_block, ratio_block, states)``, flat ``[8 k]``
        float32 on the device (a block of zeros where its spec is None); ``states`` is the
        ``(exp_avg, exp_avg_sq)`` blocks, or None where they were not measured here. A fused kernel
        reads ``m``, ``v`` (and the parameter) once per group; the plain torch fallback computes the
        update in float32 chunks of bounded size. Never synchronises with the host.
    """
    items = _adam_items(entries)
    adam = [i for i, (_, state, _) in enumerate(entries)
            if state.get("exp_avg") is not None and state.get("exp_avg_sq") is not None
            and state.get("step") is not None]  # the entries _adam_items kept
    groups: dict[tuple[torch.device, torch.dtype, torch.dtype, torch.dtype, torch.device, bool], list[int]] = {}
    for j, (m, v, p, _, _) in enumerate(items):
        own_v = state_spec is None or v is entries[adam[j]][1]["exp_avg_sq"]  # not AMSGrad's max_exp_avg_sq
        groups.setdefault((m.device, m.dtype, v.dtype, p.dtype, p.device, own_v), []).append(j)
    blocks: list[AdamBlocks] = []
    with torch.no_grad():
        for (device, m_dtype, v_dtype, _, _, own_v), members in groups.items():
            chosen = [items[j] for j in members]
            fused = None
            if fused_kernel(device) is not None and kernels.adam_kernel_takes([t for item in chosen for t in item[:3]]):
                # on the CPU fast path (float32 numpy views) m and v are cheaper whole than in the chunks
                states = state_spec if own_v and m_dtype == v_dtype and not numpy_viewable(chosen[0][0]) else None
                fused = _adam_fused(chosen, update_spec, ratio_spec, states, device)
            if fused is None:
                blocks.append(([adam[j] for j in members], *_adam_torch(chosen, update_spec, ratio_spec, device),
                               None))
            else:
                blocks.append(([adam[j] for j in members], *fused))
    return adam, blocks


def _adam_fused(items: list[_Item], update_spec: StatsSpec | None, ratio_spec: StatsSpec | None,
                state_spec: StatsSpec | None, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None] | None:
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
                                coefficients, update_spec, ratio_spec, state_spec)
    if out is None:
        return None
    update, ratio, m, v = out.view(4, -1).unbind()
    return update, ratio, (m, v) if state_spec is not None else None


def _adam_torch(items: list[_Item], update_spec: StatsSpec | None, ratio_spec: StatsSpec | None,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch ops: the float32 update (and ratio) of batches of at most ``_TEMPORARY_ELEMENTS`` elements.

    A parameter larger than that (contiguous) is cut into pieces whose partials are combined.
    Each batch costs a constant number of ``_foreach`` ops (:func:`_updates`), plus two per
    parameter for the ratio's zero-parameter fix-up (an exact ``masked_fill``: a multi-tensor
    op cannot set 0 where ``update`` is not finite), and its partials one
    :func:`partials_torch` each.
    """
    pieces: list[_Piece] = []
    for i, (m, v, p, scale, eps) in enumerate(items):
        if m.numel() == 0:
            continue  # an empty parameter keeps a row of zeros
        if m.is_contiguous() and v.is_contiguous() and p.is_contiguous() and m.numel() > _TEMPORARY_ELEMENTS:
            for chunk in zip(torch.split(m.view(-1), _TEMPORARY_ELEMENTS),
                             torch.split(v.view(-1), _TEMPORARY_ELEMENTS),
                             torch.split(p.view(-1), _TEMPORARY_ELEMENTS)):
                pieces.append((i, *chunk, scale, eps))
        else:
            pieces.append((i, m, v, p, scale, eps))
    owners: list[int] = []
    parts_u: list[torch.Tensor] = []
    parts_r: list[torch.Tensor] = []
    for batch in bounded_batches(pieces, [piece[1].numel() for piece in pieces], _TEMPORARY_ELEMENTS):
        updates = _updates(batch, device)
        owners += [piece[0] for piece in batch]
        if update_spec is not None:
            parts_u.append(partials_torch(updates, update_spec))
        if ratio_spec is not None:
            params = [piece[3] for piece in batch]
            ratios = torch._foreach_div(updates, params)
            del updates
            for ratio, param in zip(ratios, params):
                ratio.masked_fill_(param == 0, 0.0)  # a zero parameter gives ratio 0, never Inf
            parts_r.append(partials_torch(ratios, ratio_spec))
    n = len(items)
    if len(set(owners)) < n:  # empty parameters: rows of zeros
        return (_rows_of(parts_u, owners, n, device), _rows_of(parts_r, owners, n, device))
    return (_combine_pieces(parts_u, owners, n, device), _combine_pieces(parts_r, owners, n, device))


def _updates(batch: list[_Piece], device: torch.device) -> list[torch.Tensor]:
    """``m * scale / (sqrt(v) + eps')`` of each piece in float32, by multi-tensor ops on the batch.

    float32 states: ``_foreach_sqrt`` makes the one temporary list; other dtypes are widened into
    one float32 buffer of the batch's size (no per-tensor copy op). Constants that are device
    scalars (capturable Adam) take per-piece ops.
    """
    ms, vs = [piece[1] for piece in batch], [piece[2] for piece in batch]
    scales, epses = [piece[4] for piece in batch], [piece[5] for piece in batch]
    if not (_floats(scales) and _floats(epses)):
        per_piece: list[torch.Tensor] = []
        for m, v, scale, eps in zip(ms, vs, scales, epses):
            update = v.to(torch.float32, copy=True).sqrt_().add_(eps)
            per_piece.append(torch.div(m, update, out=update).mul_(scale))
        return per_piece
    denominators: list[torch.Tensor] | tuple[torch.Tensor, ...]
    if vs[0].dtype == torch.float32:
        denominators = torch._foreach_sqrt(vs)
    else:
        buffer = torch.empty(sum(v.numel() for v in vs), dtype=torch.float32, device=device)
        denominators = [flat.view(v.shape) for flat, v in zip(torch.split(buffer, [v.numel() for v in vs]), vs)]
        torch._foreach_copy_(denominators, vs)
        torch._foreach_sqrt_(denominators)
    torch._foreach_add_(denominators, epses)
    updates = torch._foreach_div(ms, denominators)  # float32 (the denominators are)
    del denominators
    torch._foreach_mul_(updates, scales)
    return list(updates)


def _floats(coefficients: list[Coefficient]) -> TypeGuard[list[float]]:
    return all(isinstance(c, float) for c in coefficients)


def _rows_of(parts: list[torch.Tensor], owners: list[int], n: int, device: torch.device) -> torch.Tensor:
    """:func:`_combine_pieces` where some of the ``n`` tensors own no piece (empty ones: rows of zeros)."""
    if not parts:
        return torch.zeros(PARTIAL_SLOTS * n, dtype=torch.float32, device=device)
    present = sorted(set(owners))
    combined = _combine_pieces(parts, [present.index(owner) for owner in owners], len(present), device)
    block = torch.zeros(n, PARTIAL_SLOTS, dtype=torch.float32, device=device)
    block[present] = combined.view(-1, PARTIAL_SLOTS)
    return block.view(-1)


def _combine_pieces(parts: list[torch.Tensor], owners: list[int], n: int, device: torch.device) -> torch.Tensor:
    """Flat ``[8 n]`` partials of ``n`` tensors from the flat partials of their pieces (``owners[k]``: piece k's)."""
    if not parts:
        return torch.zeros(PARTIAL_SLOTS * n, dtype=torch.float32, device=device)
    block = torch.cat(parts) if len(parts) > 1 else parts[0]
    if len(owners) == n:  # one piece per tensor, in order
        return block
    rows = block.view(-1, PARTIAL_SLOTS)
    combined = [combine_partials_torch(rows[[k for k, owner in enumerate(owners) if owner == i]][:, None, :])
                for i in range(n)]
    return torch.cat(combined).view(-1)


def update_ratio(update: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Elementwise ``update / param``; elements where the parameter is exactly 0 give 0
    (a zero-initialised bias would otherwise report a false Inf)."""
    param = param.detach()
    if param.device.type == "cpu" and update.dtype == param.dtype == torch.float32:
        ratio = torch.empty_like(update)
        _ratio_into(update.numpy(), param.numpy(), ratio.numpy())  # CPU views: no sync
        return ratio
    return torch.where(param != 0, update / param, 0.0)
