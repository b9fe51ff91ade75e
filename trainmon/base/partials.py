"""Partial statistics: the 8-slot vector a collector measures per tensor, and its arithmetic on the host.

``[norm, sum, min, max, zeros, nans, infs, numel]`` combines exactly across shards (:func:`combine_partials`);
:func:`finalize` and :func:`finalize_many` turn it into the user's metrics. Framework-free (numpy);
:func:`trainmon.base.records.build_record` makes a step's rows with them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

# Slots of a partial-statistics vector. A slot not needed by the configured metrics holds 0.
NORM, SUM, MIN, MAX, ZEROS, NANS, INFS, NUMEL = range(8)
PARTIAL_SLOTS = 8


def combine_partials(partials: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Combine partial statistics of shards of the same tensors.

    Args:
        partials: ``[shards, N, 8]`` array; a shard holding no element of a tensor has
            ``numel == 0`` (its min/max are ignored).

    Returns:
        ``[N, 8]`` partial statistics of the whole tensors.

    Example:
        >>> a = np.array([[[3.0, 3.0, 3.0, 3.0, 0, 0, 0, 1]], [[4.0, 4.0, 4.0, 4.0, 0, 0, 0, 1]]])
        >>> combine_partials(a)[0, NORM]
        5.0
    """
    partials = np.asarray(partials, dtype=np.float64)
    out: npt.NDArray[np.float64] = partials.sum(axis=0)
    out[:, NORM] = np.sqrt(np.square(partials[:, :, NORM]).sum(axis=0))
    has = partials[:, :, NUMEL] > 0
    with np.errstate(invalid="ignore"):
        out[:, MIN] = np.where(has, partials[:, :, MIN], np.inf).min(axis=0)
        out[:, MAX] = np.where(has, partials[:, :, MAX], -np.inf).max(axis=0)
        # A NaN min/max on any shard must survive the combination.
        nan_any = (np.isnan(partials[:, :, MIN]) | np.isnan(partials[:, :, MAX])) & has
        out[nan_any.any(axis=0), MIN] = np.nan
        out[nan_any.any(axis=0), MAX] = np.nan
    return out


def finalize(partial: Sequence[float], metrics: Sequence[str]) -> tuple[dict[str, float], bool]:
    """Turn one partial-statistics vector into ``metric -> value`` and a non-finite flag.

    ``zeros`` is a fraction of the elements; ``nans`` and ``infs`` are counts.
    An empty tensor gives NaN for every metric except the counts.
    """
    numel = float(partial[NUMEL])
    values: dict[str, float] = {}
    for metric in metrics:
        if metric == "norm":
            values[metric] = float(partial[NORM])
        elif metric == "min":
            values[metric] = float(partial[MIN]) if numel else math.nan
        elif metric == "max":
            values[metric] = float(partial[MAX]) if numel else math.nan
        elif metric == "mean":
            values[metric] = float(partial[SUM]) / numel if numel else math.nan
        elif metric == "zeros":
            values[metric] = float(partial[ZEROS]) / numel if numel else math.nan
        elif metric == "nans":
            values[metric] = float(partial[NANS])
        elif metric == "infs":
            values[metric] = float(partial[INFS])
        else:  # pragma: no cover - metrics are validated by the config
            raise AssertionError(f"unknown metric {metric!r}")
    lo, hi = float(partial[MIN]), float(partial[MAX])
    nonfinite = bool(numel) and not (math.isfinite(lo) and math.isfinite(hi))
    nonfinite = nonfinite or bool(partial[NANS] > 0 or partial[INFS] > 0)
    return values, bool(nonfinite)


def finalize_many(partials: npt.ArrayLike) -> tuple[dict[str, list[float]], list[bool]]:
    """:func:`finalize` of ``[N, 8]`` partials at once: ``metric -> N values`` and N non-finite flags."""
    p = np.asarray(partials, dtype=np.float64).reshape(-1, PARTIAL_SLOTS)
    numel = p[:, NUMEL]
    empty = numel == 0
    with np.errstate(invalid="ignore", divide="ignore"):
        per_element = np.where(empty, np.nan, 1.0 / np.where(empty, 1.0, numel))
        columns = {"norm": p[:, NORM], "min": np.where(empty, np.nan, p[:, MIN]),
                   "max": np.where(empty, np.nan, p[:, MAX]), "mean": p[:, SUM] * per_element,
                   "zeros": p[:, ZEROS] * per_element, "nans": p[:, NANS], "infs": p[:, INFS]}
        nonfinite = (~empty & ~(np.isfinite(p[:, MIN]) & np.isfinite(p[:, MAX]))) | (p[:, NANS] > 0) | (p[:, INFS] > 0)
    values = {metric: column.tolist() for metric, column in columns.items()}  # host numpy arrays: no sync
    return values, nonfinite.tolist()  # host numpy: no sync
