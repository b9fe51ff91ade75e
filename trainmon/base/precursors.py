"""Per-parameter precursors of Adam instability (family ``precursors``, docs/precursors.md): their slots and
how the host turns them into values.

A parameter's precursor row is measured on the device as two 8-slot vectors, the row itself (family
``precursors``) and a hidden second half (:data:`PRECURSORS_TAIL`), laid out so that the ordinary combination of
shards' partials (:func:`trainmon.base.partials.combine_partials`: slot 0 the square root of the sum of squares,
slot 2 the min, slot 3 the max, the other slots summed) combines them exactly, with no code of their own in
an integration. With ``g`` the gradient the optimizer stepped with, ``m``, ``v`` its Adam moments after the
step (AMSGrad: ``max_exp_avg_sq``), ``v_hat = v / (1 - beta2^t)``, ``u = m_hat / (sqrt(v_hat) + eps)`` (the
``update`` family), ``p`` the parameter after the step and ``n`` its element count::

    head  [ |u|, u.g, 0, max r, m.g, sum r, #(v_hat < eps^2), n ]    r = g^2 / max(v_hat, eps^2) (0 where g = 0)
    tail  [ |p|, lr * n, 0, 0, |g|^2, |m|^2, 0, n ]

``lr * n`` sums to ``lr`` times the whole element count over shards that share the learning rate.
:func:`finalize_precursors` divides the combined sums: nothing here imports a framework.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

PRECURSORS = "precursors"
"""The family of the precursor rows."""
PRECURSORS_TAIL = "precursors.tail"
"""The hidden family of each precursor row's second 8-slot vector (never written: :func:`pair_tails` joins it to
its row before the record is built)."""
PRECURSOR_METRICS: tuple[str, ...] = (
    "update_weight_ratio", "g2_v_rms", "g2_v_max", "eps_underflow", "cos_update_grad", "cos_m_g")
"""The columns of the ``precursors`` family, in order."""

# slots of the head and the tail (module docstring)
UPDATE_NORM, UPDATE_DOT_GRAD, RATIO_MAX, M_DOT_GRAD, RATIO_SUM, UNDERFLOW, COUNT = 0, 1, 3, 4, 5, 6, 7
PARAM_NORM, LR_COUNT, GRAD_SQUARES, M_SQUARES = 0, 1, 4, 5


def _cosine(dot: npt.NDArray[np.float64], first_squares: npt.NDArray[np.float64],
            second_squares: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """``dot / (|a| |b|)``, 0 where a vector is 0, clipped to [-1, 1] (float32 sums can pass 1 by rounding)."""
    denominator = np.sqrt(first_squares) * np.sqrt(second_squares)
    with np.errstate(invalid="ignore", divide="ignore"):
        cosine = np.where(denominator > 0, dot / np.where(denominator > 0, denominator, 1.0), 0.0)
    cosine = np.where(np.isnan(dot) | np.isnan(denominator), np.nan, cosine)
    clipped: npt.NDArray[np.float64] = np.clip(cosine, -1.0, 1.0)
    return clipped


def finalize_precursors(head: npt.ArrayLike, tail: npt.ArrayLike) -> tuple[dict[str, list[float]], list[bool]]:
    """The ``precursors`` values of ``k`` rows from their combined ``[k, 8]`` heads and tails.

    Returns ``metric -> k values`` (:data:`PRECURSOR_METRICS`) and ``k`` non-finite flags: a NaN or an Inf in
    ``g``, ``m``, ``v``, ``u`` or ``p`` (it makes their sums non-finite). A row of no element gives NaN values.
    ``update_weight_ratio`` is 0 where ``|p|`` is 0 (as the ``ratio`` family's rule); a cosine is 0 where one
    of its vectors is 0.

    Example:
        >>> head = [[2.0, 2.0, 0.0, 1.0, 1.0, 2.0, 1.0, 4.0]]
        >>> tail = [[4.0, 0.004, 0.0, 0.0, 4.0, 1.0, 0.0, 4.0]]
        >>> values, nonfinite = finalize_precursors(head, tail)
        >>> values["update_weight_ratio"], values["g2_v_rms"], values["eps_underflow"], values["cos_m_g"]
        ([0.0005], [0.7071067811865476], [0.25], [0.5])
    """
    h = np.asarray(head, dtype=np.float64).reshape(-1, 8)
    t = np.asarray(tail, dtype=np.float64).reshape(-1, 8)
    count = h[:, COUNT]
    empty = count == 0
    with np.errstate(invalid="ignore", divide="ignore"):
        per_element = np.where(empty, np.nan, 1.0 / np.where(empty, 1.0, count))
        lr = t[:, LR_COUNT] * per_element
        step_norm = lr * h[:, UPDATE_NORM]
        param_norm = t[:, PARAM_NORM]
        ratio = np.where(param_norm > 0, step_norm / np.where(param_norm > 0, param_norm, 1.0), 0.0)
        ratio = np.where(np.isnan(step_norm) | np.isnan(param_norm), np.nan, ratio)
        columns = {
            "update_weight_ratio": ratio,
            "g2_v_rms": np.sqrt(h[:, RATIO_SUM] * per_element),
            "g2_v_max": np.where(empty, np.nan, h[:, RATIO_MAX]),
            "eps_underflow": h[:, UNDERFLOW] * per_element,
            "cos_update_grad": np.where(empty, np.nan, _cosine(h[:, UPDATE_DOT_GRAD], np.square(h[:, UPDATE_NORM]),
                                                               t[:, GRAD_SQUARES])),
            "cos_m_g": np.where(empty, np.nan, _cosine(h[:, M_DOT_GRAD], t[:, M_SQUARES], t[:, GRAD_SQUARES])),
        }
    sums = np.stack([h[:, UPDATE_NORM], h[:, UPDATE_DOT_GRAD], h[:, RATIO_MAX], h[:, M_DOT_GRAD], h[:, RATIO_SUM],
                     t[:, PARAM_NORM], t[:, GRAD_SQUARES], t[:, M_SQUARES]], axis=1)
    nonfinite = ~empty & ~np.isfinite(sums).all(axis=1)
    return {metric: columns[metric].tolist() for metric in PRECURSOR_METRICS}, nonfinite.tolist()  # host numpy


def pair_tails(keys: Any) -> tuple[list[int], list[int]]:
    """``(rows, tails)``: the indices of the keys that are not tails, and for each the index of its tail (-1 for
    a row of another family, or a precursor row whose tail is missing: then its values are NaN).

    A tail is the :data:`PRECURSORS_TAIL` key of the same name, micro-step and virtual-pipeline stage."""
    tails: dict[tuple[str, int, int], int] = {}
    rows: list[int] = []
    for i, key in enumerate(keys):
        if key.family == PRECURSORS_TAIL:
            tails[(key.name, key.micro_step, key.vpp_stage)] = i
        else:
            rows.append(i)
    return rows, [tails.get((keys[i].name, keys[i].micro_step, keys[i].vpp_stage), -1)
                  if keys[i].family == PRECURSORS else -1 for i in rows]


def nan_tail() -> npt.NDArray[np.float64]:
    """The tail of a precursor row whose tail is missing (a failed part): its values come out NaN."""
    return np.full(8, math.nan)


__all__ = ["PRECURSORS", "PRECURSORS_TAIL", "PRECURSOR_METRICS", "finalize_precursors", "nan_tail", "pair_tails"]
