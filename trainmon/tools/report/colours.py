"""The colour codes of the heatmaps of ``trainmon report`` and ``trainmon serve`` (framework-free): a
:class:`~trainmon.tools.report.grids.Grid`'s envelopes as the page's one byte per cell, in its two modes.

``change`` (the default) shows each cell against its row's reference as a log10 ratio (:func:`change`: the running
median of the row's previous :data:`~trainmon.tools.report.grids.WINDOW` columns, or in ``ranks`` the row's median
over the ranks); ``abs`` the log10 of the largest magnitude from the grid's smallest to its largest
(:mod:`trainmon.tools.report.grids` says more, and queries the grids). :func:`encode` writes both.
"""

from __future__ import annotations

import base64
import warnings
from typing import Any

import numpy as np
import numpy.typing as npt

from trainmon.tools.report.grids import (
    CHANGE_LEVELS,
    CHANGE_RANGE,
    NAN,
    NEG_INF,
    WINDOW,
    Axis,
    Floats,
    Grid,
    log_levels,
)


def running_median(values: Floats, window: int = WINDOW) -> Floats:
    """Each cell's median over the previous ``window`` columns of its row, NaN ignored (NaN where none).

    Example:
        >>> running_median(np.array([[1.0, 2.0, 4.0, np.nan, 8.0]]), window=2).tolist()
        [[nan, 1.0, 1.5, 3.0, 4.0]]
    """
    rows, cols = values.shape
    out = np.full(values.shape, np.nan)
    if cols < 2:
        return out
    padded = np.concatenate([np.full((rows, window), np.nan), values], axis=1)
    for start in range(0, rows, 256):  # [256, cols, window] doubles at a time
        block = np.sort(np.lib.stride_tricks.sliding_window_view(padded[start:start + 256], window, axis=1)[:, :cols],
                        axis=2)  # NaN sort last
        count = window - np.isnan(block).sum(axis=2)
        low = np.take_along_axis(block, np.maximum((count - 1) // 2, 0)[..., None], axis=2)[..., 0]
        high = np.take_along_axis(block, np.maximum(count // 2, 0)[..., None], axis=2)[..., 0]
        out[start:start + 256] = np.where(count > 0, (low + high) / 2, np.nan)
    return out


def log_ratio(value: Floats, reference: Floats) -> Floats:
    """log10(value / reference) of magnitudes, 0 where the reference is unknown, +-:data:`CHANGE_RANGE` where one
    side is zero (and 0 where both are).

    Example:
        >>> log_ratio(np.array([8.0, 0.0, 1.0, 2.0]), np.array([1.0, 1.0, 0.0, np.nan])).tolist()
        [0.9030899869919435, -1.0, 1.0, 0.0]
    """
    out = np.zeros(value.shape)
    known = np.isfinite(value) & np.isfinite(reference)
    both = known & (value > 0) & (reference > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out[both] = np.log10(value[both] / reference[both])
    out[known & (value == 0) & (reference > 0)] = -CHANGE_RANGE
    out[known & (value > 0) & (reference == 0)] = CHANGE_RANGE
    return out


def change(grid: Grid) -> Floats:
    """The ``change`` value of each cell (decades, before clipping); computed once per grid."""
    if grid.shift is None:
        grid.shift = _change(grid)
    return grid.shift


def _change(grid: Grid) -> Floats:
    if grid.view == "ranks":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            high_ref = np.nanmedian(grid.high, axis=1, keepdims=True) * np.ones_like(grid.high)
            low_ref = np.nanmedian(grid.low, axis=1, keepdims=True) * np.ones_like(grid.low)
    else:
        high_ref = running_median(grid.high)
        # one value per cell (a column of one step, one micro-step): the smallest is the largest
        same = np.array_equal(grid.high, grid.low, equal_nan=True)
        low_ref = high_ref if same else running_median(grid.low)
    up, down = log_ratio(grid.high, high_ref), log_ratio(grid.low, low_ref)
    return np.where(np.abs(up) >= np.abs(down), up, down)


def _b64(codes: npt.NDArray[np.uint8]) -> str:
    return base64.b64encode(np.ascontiguousarray(codes, np.uint8).tobytes()).decode("ascii")


def crop(grid: Grid, first: int) -> Grid:
    """``grid`` without its columns before step ``first`` (queried as history for the running median)."""
    keep = np.array([start >= first for start in grid.cols.starts], bool)
    cols = Axis(grid.cols.kind, [s for s, k in zip(grid.cols.starts, keep) if k], grid.cols.width, grid.cols.last)
    return Grid(grid.view, grid.family, grid.metric, grid.at, cols, grid.high[:, keep], grid.low[:, keep],
                grid.special[:, keep], grid.row_keys, grid.row_first, grid.rank_rows, grid.module)


def largest_change(grid: Grid) -> tuple[int, int, float] | None:
    """``(row, column, decades)`` of the cell that changed most (None: no finite cell changed)."""
    shift = change(grid)
    masked = np.where(grid.special == 0, np.abs(shift), -1.0)
    if not masked.size or masked.max() <= 0:
        return None
    row, col = np.unravel_index(int(np.argmax(masked)), masked.shape)
    return int(row), int(col), float(shift[row, col])


def encode(grid: Grid, first: int | None = None) -> dict[str, Any]:
    """The page's form of a grid: ``abs`` and ``change`` codes (base64, row-major), axes and the largest change.

    Args:
        first: drop the columns before this step after computing the change (history for the running median).
    """
    if first is not None:
        shifted = change(grid)
        grid = crop(grid, first)
        shift = shifted[:, shifted.shape[1] - grid.high.shape[1]:]
    else:
        shift = change(grid)
    special = grid.special
    finite = special == 0
    high = grid.high
    codes = special.copy()
    lo, hi = log_levels(codes, high, finite)
    change_codes = special.copy()
    change_codes[finite] = np.rint(np.clip(shift[finite], -CHANGE_RANGE, CHANGE_RANGE) / CHANGE_RANGE
                                   * CHANGE_LEVELS) + CHANGE_LEVELS
    out: dict[str, Any] = {"view": grid.view, "family": grid.family, "metric": grid.metric, "at": grid.at,
                           "shape": [int(high.shape[0]), int(high.shape[1])], "cols": grid.cols.to_json(),
                           "abs": {"lo": lo, "hi": hi, "data": _b64(codes)},
                           "change": {"range": CHANGE_RANGE, "window": WINDOW if grid.view != "ranks" else None,
                                      "data": _b64(change_codes)},
                           "nonfinite": int(((special >= NAN) & (special <= NEG_INF)).sum())}
    if grid.rank_rows is not None:
        out["rank_rows"] = grid.rank_rows.to_json()
    if grid.module is not None:
        out["module"] = list(grid.module)
    masked = np.where(finite, np.abs(shift), -1.0)
    if masked.size and masked.max() > 0:
        row, col = np.unravel_index(int(np.argmax(masked)), masked.shape)
        out["largest"] = {"row": int(row), "col": int(col), "decades": float(shift[row, col])}
    return out


def encoded_size(rows: int, cols: int) -> int:
    """Bytes of one encoded grid on the page: two base64 codes per cell and some JSON around them."""
    return 2 * 4 * ((rows * cols + 2) // 3) + 400


__all__ = ["change", "crop", "encode", "encoded_size", "largest_change", "log_ratio", "running_median"]
