"""The curves of ``trainmon report``: loss, grad norm, loss scale and learning rates of one rank, from SQL.

Steps are cut into buckets of equal width, at most ``max_points`` of them; each point is the first step of its
bucket with the min and the max of the bucket's finite values (equal when a bucket holds one step), so a
one-step spike of the loss stays on the curve. NaN and Inf values are listed apart (``bad``, the first 1,000).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trainmon.tools.report.grids import bucket_width
from trainmon.tools.report.source import RunSource

CURVES = ("loss", "grad_norm", "loss_scale")
"""Scalars drawn as curves, besides every ``lr/group{i}``."""
BAD_STEPS = 1000
"""NaN/Inf steps listed per curve, at most."""
_WHERE = "(name IN ('loss', 'grad_norm', 'loss_scale') OR name LIKE 'lr/%')"


def curves(source: RunSource, rank: int, max_points: int) -> dict[str, Any]:
    """``name -> {"steps", "lo", "hi", "per_bin", "bad", "bad_total"}`` of one rank's scalars.

    ``per_bin`` is the bucket width in steps; ``lo``/``hi`` are null where a bucket has no finite value.
    """
    span = source.query(f"SELECT count(*) AS n, coalesce(min(step), 0) AS first, coalesce(max(step), 0) AS last "
                        f"FROM scalars WHERE rank = {int(rank)} AND {_WHERE}")
    if not int(span["n"][0]):
        return {}
    first, last = int(span["first"][0]), int(span["last"][0])
    width = bucket_width(first, last, max_points)
    points = source.query(
        f"SELECT name, min(step) AS step, coalesce(min(value) FILTER (WHERE isfinite(value)), 'NaN') AS lo, "
        f"coalesce(max(value) FILTER (WHERE isfinite(value)), 'NaN') AS hi FROM scalars "
        f"WHERE rank = {int(rank)} AND {_WHERE} GROUP BY name, (step - {first}) // {width} ORDER BY name, step")
    bad = source.query(f"SELECT name, step FROM scalars WHERE rank = {int(rank)} AND {_WHERE} AND NOT isfinite(value) "
                       "ORDER BY name, step")
    out: dict[str, Any] = {}
    names = points["name"]
    for name in dict.fromkeys(names.tolist()):  # numpy: no device
        mask = names == name
        bad_steps = bad["step"][bad["name"] == name]
        out[str(name)] = {"steps": [int(s) for s in points["step"][mask]], "lo": _floats(points["lo"][mask]),
                          "hi": _floats(points["hi"][mask]), "per_bin": width,
                          "bad": [int(s) for s in bad_steps[:BAD_STEPS]], "bad_total": int(len(bad_steps))}
    return out


def _floats(values: Any) -> list[float | None]:
    """Floats of a column, None where not finite (NaN: a bucket without a finite value)."""
    return [float(v) if math.isfinite(v) else None for v in np.asarray(values, np.float64).tolist()]  # numpy: no device


__all__ = ["BAD_STEPS", "CURVES", "curves"]
