"""The overview's summaries of a metric over the tensors of a step (framework-free): :data:`OVERVIEW_STATS` and
:func:`summarise`, shared by the TensorBoard sink and ``trainmon csv2tb`` through
:mod:`trainmon.sinks.tensorboard_overview` (the tags, the tables and the bounds).

NaN: a NaN norm is a NaN in the data (an empty tensor's norm is 0), so ``norm_max`` is NaN when any tensor's norm
is (TensorBoard marks the step with a triangle) and ``norm_argmax`` names the first such tensor; the other
metrics are NaN for an empty tensor too (a MoE expert that got no token), so their summaries skip NaN, as every
median does. Inf is a value: it is the max where it occurs.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from trainmon.base.records import ROW_METRICS

OVERVIEW_STATS: dict[str, tuple[str, ...]] = {
    "norm": ("max", "median", "argmax"), "max": ("max",), "min": ("min",), "mean": ("median",),
    "zeros": ("max",), "nans": ("sum",), "infs": ("sum",),
    # the model features (docs/features.md): the extreme that warns, and the typical value
    "max_logit": ("max", "median"), "entropy": ("min", "median"), "imbalance": ("max",), "z_loss": ("max",),
    "expert_similarity": ("max",), "tokens": ("min", "max"), "share": (), "spectral_norm": ("max",),
    "stable_rank": ("min", "median"),
    # the precursors family's (docs/precursors.md): the layer furthest out, and the typical one for the ratio
    "update_weight_ratio": ("max", "median"), "g2_v_rms": ("max",), "g2_v_max": ("max",), "eps_underflow": ("max",),
    "cos_update_grad": ("min",), "cos_m_g": ("min",),
}
"""The summaries of each metric over the tensors of a step (their tags: :mod:`trainmon.sinks.tensorboard_overview`)."""
NONFINITE = "nonfinite_tensors"
"""Tensors whose norm is NaN or Inf, or that hold a NaN or Inf (``nans``/``infs`` > 0), per family and step."""


def summarise(columns: dict[str, npt.NDArray[np.float64]], starts: npt.NDArray[np.int64],
              index: npt.NDArray[np.int64] | None = None,
              nonfinite_of: dict[str, npt.NDArray[np.float64]] | None = None,
              masks: npt.NDArray[np.bool_] | None = None) -> dict[str, npt.NDArray[np.float64]]:
    """The summaries of :data:`OVERVIEW_STATS` per group of rows (group i: rows ``starts[i]:starts[i + 1]``).

    Args:
        columns: ``metric -> value per row``; metrics without a summary are skipped.
        starts: the first row of each group (increasing, from 0; no group empty).
        index: the table index of each row (``norm_argmax`` gives the index of its group's ``norm_max`` row).
        nonfinite_of: the columns ``nonfinite_tensors`` is counted from (default ``columns``).
        masks: whether each row is an attention mask: its -inf (an infinite norm, ``infs``) are its values, and it
            counts as non-finite only with a NaN (a NaN norm, ``nans``) or a +inf ``max``, as the rows' own flags.

    Returns:
        ``{metric}_{stat}`` (and ``nonfinite_tensors``) -> one value per group.

    Example:
        >>> out = summarise({"norm": np.array([3.0, np.nan, 1.0, 2.0])}, np.array([0, 2]), np.array([5, 6, 7, 8]))
        >>> out["norm_max"].tolist(), out["norm_median"].tolist(), out["norm_argmax"].tolist()
        ([nan, 2.0], [3.0, 1.5], [6.0, 8.0])
    """
    out: dict[str, npt.NDArray[np.float64]] = {}
    if not columns and not nonfinite_of:
        return out
    count = len(next(iter((columns or nonfinite_of or {}).values())))
    sizes = np.diff(np.append(starts, count))
    group = np.repeat(np.arange(len(starts)), sizes)
    with np.errstate(invalid="ignore", over="ignore"):
        for metric, column in columns.items():
            for stat in OVERVIEW_STATS.get(metric, ()):
                if stat == "max":
                    # a NaN norm is NaN data, other NaN values are empty tensors (see the module docstring)
                    out[f"{metric}_max"] = (np.maximum if metric == "norm" else np.fmax).reduceat(column, starts)
                elif stat == "min":
                    out[f"{metric}_min"] = np.fmin.reduceat(column, starts)
                elif stat == "sum":
                    out[f"{metric}_sum"] = np.add.reduceat(column, starts)
                elif stat == "median":
                    out[f"{metric}_median"] = _medians(column, starts, group)
                elif stat == "argmax" and index is not None:
                    largest = np.maximum.reduceat(column, starts)[group]
                    holds = (column == largest) | (np.isnan(column) & np.isnan(largest))
                    first = np.minimum.reduceat(np.where(holds, np.arange(count), count), starts)
                    out[f"{metric}_argmax"] = index[first].astype(np.float64)
        source = columns if nonfinite_of is None else nonfinite_of
        if {"norm", "nans", "infs"} & set(source):
            flags = np.zeros(count, bool)
            if "norm" in source:
                flags |= ~np.isfinite(source["norm"])
            for metric in ("nans", "infs"):
                if metric in source:
                    flags |= source[metric] > 0
            if masks is not None and masks.any():  # a mask's -inf: only NaN or +inf count
                own = np.zeros(count, bool)
                if "norm" in source:
                    own |= np.isnan(source["norm"])
                if "nans" in source:
                    own |= source["nans"] > 0
                if "max" in source:
                    own |= source["max"] == np.inf
                flags = np.where(masks, own, flags)
            out[NONFINITE] = np.add.reduceat(flags.astype(np.float64), starts)
    return out


def _medians(column: npt.NDArray[np.float64], starts: npt.NDArray[np.int64],
             group: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
    """The median of the non-NaN values of each group, as ``np.nanmedian`` computes it (NaN for none)."""
    ordered = column[np.lexsort((column, group))]  # NaN sorts last within its group
    valid = np.add.reduceat((~np.isnan(column)).astype(np.int64), starts)
    low = starts + np.maximum(valid - 1, 0) // 2
    high = starts + valid // 2
    high = np.where(valid > 0, high, starts)
    middle = np.where(low == high, ordered[low], (ordered[low] + ordered[high]) / 2)  # under summarise's errstate
    return np.where(valid > 0, middle, np.nan)


__all__ = ["NONFINITE", "OVERVIEW_STATS", "summarise"]

assert set(OVERVIEW_STATS) == set(ROW_METRICS)
