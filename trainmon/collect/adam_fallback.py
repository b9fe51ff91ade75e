"""The Adam update's statistics by plain torch ops: the fallback of :func:`trainmon.collect.adam.adam_partials_many`
where no fused kernel takes a group's tensors.

The float32 update (and ratio, and the precursor rows) of batches of at most :data:`TEMPORARY_ELEMENTS` elements, a
larger parameter cut into pieces whose partials are combined; never synchronises with the host.
"""

from __future__ import annotations

from typing import TypeAlias, TypeGuard

import torch

from trainmon.base.partials import PARTIAL_SLOTS
from trainmon.collect.fallback import bounded_batches
from trainmon.collect.precursor_ops import precursor_rows_torch
from trainmon.collect.stats import combine_partials_torch, partials_torch
from trainmon.collect.stats_base import StatsSpec

Coefficient: TypeAlias = "float | torch.Tensor"
"""A constant of the update: a host float, or a 0-d tensor on the step counter's device (capturable Adam)."""
AdamItem: TypeAlias = ("tuple[torch.Tensor, torch.Tensor, torch.Tensor, Coefficient, Coefficient, Coefficient, "
                        "Coefficient, float, float]")
"""``(m, v, param, scale, eps', lr, 1 - beta2^t, sign, coupled decay)`` of one parameter (``adam._adam_items``)."""
_Piece: TypeAlias = ("tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, Coefficient, Coefficient, "
                     "torch.Tensor | None, Coefficient, Coefficient, float, float]")
"""``(owner, m, v, param, scale, eps', grad or None, lr, 1 - beta2^t, sign, coupled decay)``: a whole parameter or
a contiguous chunk of parameter ``owner``."""

TEMPORARY_ELEMENTS = 1 << 22
"""Plain torch fallback: elements of update (and ratio) temporaries alive at once (16 MiB each in float32)."""


def adam_partials_torch(items: list[AdamItem], update_spec: StatsSpec | None, ratio_spec: StatsSpec | None,
                        device: torch.device, grads: list[torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor, None, tuple[torch.Tensor, torch.Tensor] | None]:
    """Plain torch ops: the float32 update (and ratio) of batches of at most ``TEMPORARY_ELEMENTS`` elements.

    A parameter larger than that (contiguous) is cut into pieces whose partials are combined.
    Each batch costs a constant number of ``_foreach`` ops (:func:`_updates`), plus two per
    parameter for the ratio's zero-parameter fix-up (an exact ``masked_fill``: a multi-tensor
    op cannot set 0 where ``update`` is not finite), and its partials one
    :func:`partials_torch` each. With ``grads`` (one per item), the precursor rows too, about 15 ops per
    piece (:func:`~trainmon.collect.precursor_ops.precursor_rows_torch`).
    """
    pieces: list[_Piece] = []
    for i, (m, v, p, scale, eps, lr, bias2, sign, decay) in enumerate(items):
        g = grads[i] if grads else None
        if m.numel() == 0:
            continue  # an empty parameter keeps a row of zeros
        contiguous = m.is_contiguous() and v.is_contiguous() and p.is_contiguous() and (g is None or g.is_contiguous())
        if contiguous and m.numel() > TEMPORARY_ELEMENTS:
            for chunk in zip(torch.split(m.view(-1), TEMPORARY_ELEMENTS),
                             torch.split(v.view(-1), TEMPORARY_ELEMENTS),
                             torch.split(p.view(-1), TEMPORARY_ELEMENTS),
                             torch.split(g.view(-1), TEMPORARY_ELEMENTS) if g is not None
                             else [None] * -(-m.numel() // TEMPORARY_ELEMENTS)):
                pieces.append((i, chunk[0], chunk[1], chunk[2], scale, eps, chunk[3], lr, bias2, sign, decay))
        else:
            pieces.append((i, m, v, p, scale, eps, g, lr, bias2, sign, decay))
    owners: list[int] = []
    parts_u: list[torch.Tensor] = []
    parts_r: list[torch.Tensor] = []
    parts_p: list[torch.Tensor] = []
    for batch in bounded_batches(pieces, [piece[1].numel() for piece in pieces], TEMPORARY_ELEMENTS):
        updates = _updates(batch, device)
        owners += [piece[0] for piece in batch]
        if update_spec is not None:
            parts_u.append(partials_torch(updates, update_spec))
        if grads:
            rows = [precursor_rows_torch(update, piece[1], piece[2], piece[3], piece[6], piece[5], piece[7], piece[8],
                                         piece[9], piece[10])
                    for update, piece in zip(updates, batch) if piece[6] is not None]
            parts_p.append(torch.stack(rows))  # [k, 16]: head and tail per piece
        if ratio_spec is not None:
            params = [piece[3] for piece in batch]
            ratios = torch._foreach_div(updates, params)
            del updates
            for ratio, param in zip(ratios, params):
                ratio.masked_fill_(param == 0, 0.0)  # a zero parameter gives ratio 0, never Inf
            parts_r.append(partials_torch(ratios, ratio_spec))
    n = len(items)
    rows_of = _rows_of if len(set(owners)) < n else _combine_pieces  # empty parameters: rows of zeros
    precursors = None
    if grads:
        stacked = torch.cat(parts_p) if parts_p else torch.zeros(0, 2 * PARTIAL_SLOTS, device=device)
        precursors = (rows_of([stacked[:, :PARTIAL_SLOTS].reshape(-1)], owners, n, device),
                      rows_of([stacked[:, PARTIAL_SLOTS:].reshape(-1)], owners, n, device))
    return rows_of(parts_u, owners, n, device), rows_of(parts_r, owners, n, device), None, precursors


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


__all__ = ["TEMPORARY_ELEMENTS", "AdamItem", "Coefficient", "adam_partials_torch"]
