"""The curves of ``trainmon report``: loss, grad norm, loss scale and learning rates of one rank, from SQL.

Steps are cut into buckets of equal width, at most ``max_points`` of them; each point is the first step of its
bucket with the min and the max of the bucket's finite values (equal when a bucket holds one step), so a
one-step spike of the loss stays on the curve. NaN and Inf values are listed apart (``bad``, the first 1,000).
"""

from __future__ import annotations

import math
from typing import Any

from trainmon.tools.report.grids import bucket_width
from trainmon.tools.report.source import RunSource

CURVES = ("loss", "grad_norm", "loss_scale")
"""Scalars drawn as curves, besides every ``lr/group{i}``."""
BAD_STEPS = 1000
"""NaN/Inf steps listed per curve, at most."""
_WHERE = "(name IN ('loss', 'grad_norm', 'loss_scale') OR name LIKE 'lr/%')"


def curves(source: RunSource, rank: int, max_points: int) -> dict[str, Any]:
    """``name -> {"steps", "lo", "hi", "per_bin", "bad", "bad_total"}`` of one rank's scalars (one query).

    ``per_bin`` is the bucket width in steps (buckets of the run's scalar steps, the same for every rank);
    ``lo``/``hi`` are null where a bucket has no finite value.
    """
    if source.scalar_steps is None:
        return {}
    first, last = source.scalar_steps
    width = bucket_width(first, last, max_points)
    points = source.arrow(
        f"SELECT name, min(step) AS step, coalesce(min(value) FILTER (WHERE isfinite(value)), 'NaN') AS lo, "
        f"coalesce(max(value) FILTER (WHERE isfinite(value)), 'NaN') AS hi, "
        f"list(step ORDER BY step) FILTER (WHERE NOT isfinite(value)) AS bad FROM scalars "
        f"WHERE rank = {int(rank)} AND {_WHERE} GROUP BY name, (step - {first}) // {width} ORDER BY name, step")
    columns = {name: points.column(name).to_pylist() for name in points.column_names}
    out: dict[str, Any] = {}
    for i, name in enumerate(columns["name"]):
        curve = out.setdefault(str(name), {"steps": [], "lo": [], "hi": [], "per_bin": width, "bad": [],
                                           "bad_total": 0})
        curve["steps"].append(int(columns["step"][i]))
        curve["lo"].append(_float(columns["lo"][i]))
        curve["hi"].append(_float(columns["hi"][i]))
        bad = columns["bad"][i] or []
        curve["bad"] += bad[:max(0, BAD_STEPS - len(curve["bad"]))]
        curve["bad_total"] += len(bad)
    return out


def _float(value: Any) -> float | None:
    """A float, None where not finite (NaN: a bucket without a finite value)."""
    return float(value) if value is not None and math.isfinite(value) else None


__all__ = ["BAD_STEPS", "CURVES", "curves"]
