"""The heatmaps of ``trainmon report`` and ``trainmon serve``: SQL envelopes (framework-free); their colour codes
are :mod:`trainmon.tools.report.colours`'s.

Three views, each a grid of cells queried with one ``GROUP BY`` (DuckDB, on the store or on CSV files taken in,
:mod:`trainmon.tools.report.source`):

- ``steps``: module x step for one rank (rows: the family's rows, :mod:`trainmon.tools.report.rows`);
- ``ranks``: module x rank at one step;
- ``module``: rank x step for one row.

**Downsampling keeps spikes.** Steps (and ranks, beyond ``max_ranks``) are cut into buckets of equal width, at
most ``columns`` of them; a cell holds the *envelope* of its values over the bucket's steps, micro-steps (and
ranks): the largest and the smallest magnitude, so a one-step spike (or drop) is never averaged away. A NaN or
Inf anywhere in a cell wins (its own colour). Empty buckets are dropped, so sparse steps are not white stripes.

**Two colour modes**, each one byte per cell (base64 on the page):

- ``change`` (the default): each cell against its row's reference, as a log10 ratio: in ``steps`` and ``module``
  the running median of the row's previous :data:`WINDOW` columns, in ``ranks`` the row's median over the ranks.
  The largest magnitude is compared with the reference of the largest magnitudes, the smallest with that of the
  smallest, and the larger deviation is shown, from -:data:`CHANGE_RANGE` to +:data:`CHANGE_RANGE` decades
  (clipped). A row that is steady is white whatever its level, so a jump shows however much the rows differ.
- ``abs``: log10 of the largest magnitude from the grid's smallest to its largest (what the report showed before).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow.compute as pc

from trainmon.tools.report.rows import RowSet, order_rows
from trainmon.tools.report.source import RunSource, identifier, source_filter

Floats = npt.NDArray[np.float64]
LEVELS = 250
"""Colour levels of the ``abs`` mode (codes 0..249)."""
CHANGE_LEVELS = 124
"""Levels on each side of no change (codes 0..248, 124 = the reference)."""
ZERO, NAN, POS_INF, NEG_INF, MISSING = 250, 251, 252, 253, 255
"""Codes of a zero (``abs``), a NaN, +Inf, -Inf and an empty cell."""

CHANGE_RANGE = 1.0
"""Decades of change at either end of the ``change`` colour scale (x0.1 .. x10)."""
WINDOW = 16
"""Columns before a cell whose median is its reference in the ``change`` mode of ``steps`` and ``module``."""
MAX_RANKS = 512
"""Rank columns (``ranks``) and rank rows (``module``) at most; more ranks are bucketed like steps."""


def log_levels(codes: npt.NDArray[np.uint8], values: Floats, seen: npt.NDArray[np.bool_]
               ) -> tuple[float, float]:
    """In place: ``codes`` of the ``seen`` cells of ``values``: ZERO for a 0, else ``LEVELS`` levels of ``log10``
    between the smallest and the largest positive value (the report's and the heatmaps' one colour scale).
    Returns those two ``log10`` bounds ``(lo, hi)`` (0, 0 when no value is positive)."""
    nonzero = seen & (values > 0)
    codes[seen & (values == 0)] = ZERO
    logs = np.log10(values[nonzero])
    lo, hi = (float(logs.min()), float(logs.max())) if logs.size else (0.0, 0.0)
    span = hi - lo if hi > lo else 1.0
    codes[nonzero] = np.clip(np.rint((logs - lo) / span * (LEVELS - 1)), 0, LEVELS - 1)
    return lo, hi


@dataclass
class Axis:
    """The columns (or rank rows) of a grid: each the first step (rank) of a bucket of ``width``.

    Attributes:
        kind: ``"steps"`` or ``"ranks"``.
        starts: the first step (rank) of each bucket that holds data.
        width: steps (ranks) per bucket.
        last: the last step (rank) of the range.
    """

    kind: str
    starts: list[int]
    width: int
    last: int

    def to_json(self) -> dict[str, Any]:
        """``{kind: starts, "width", "last"}``."""
        return {self.kind: self.starts, "width": self.width, "last": self.last}


@dataclass
class Grid:
    """One heatmap before encoding: the envelope of each cell.

    Attributes:
        view: ``steps``, ``ranks`` or ``module``.
        family: the family.
        metric: the metric.
        at: the rank (``steps``), the step (``ranks``) or the row label (``module``).
        cols: the column axis.
        high: the largest finite magnitude of each cell ``[rows, cols]`` (NaN: none).
        low: the smallest finite magnitude.
        special: per cell 0, or the code of a NaN, +Inf, -Inf or an empty cell.
        row_keys: ``(vpp_stage, name)`` of each row (``steps``, ``ranks``); empty for ``module``.
        row_first: each row's smallest ``order`` (its execution position).
        rank_rows: the rank axis of a ``module`` grid.
        module: ``(vpp_stage, name)`` of a ``module`` grid.
    """

    view: str
    family: str
    metric: str
    at: Any
    cols: Axis
    high: Floats
    low: Floats
    special: npt.NDArray[np.uint8]
    row_keys: list[tuple[int, str]] = field(default_factory=list)
    row_first: list[float] = field(default_factory=list)
    rank_rows: Axis | None = None
    module: tuple[int, str] | None = None
    shift: Floats | None = field(default=None, repr=False, compare=False)

    @property
    def cells(self) -> int:
        """Rows x columns."""
        return int(self.high.size)

    def reordered(self, rows: RowSet) -> Grid:
        """This grid with its rows in the order (and number) of ``rows``; rows it lacks are empty."""
        index = rows.index()
        target = np.array([index[key] for key in self.row_keys], dtype=np.int64)
        shape = (len(rows.keys), self.high.shape[1])
        high, low = np.full(shape, np.nan), np.full(shape, np.nan)
        special = np.full(shape, MISSING, np.uint8)
        high[target], low[target], special[target] = self.high, self.low, self.special
        shift = None
        if self.shift is not None:
            shift = np.zeros(shape)
            shift[target] = self.shift
        return Grid(self.view, self.family, self.metric, self.at, self.cols, high, low, special, list(rows.keys),
                    [], self.rank_rows, self.module, shift)


def bucket_width(first: int, last: int, columns: int) -> int:
    """Steps (ranks) per bucket so that ``first..last`` fits in ``columns`` buckets.

    Example:
        >>> bucket_width(0, 99_999, 1000), bucket_width(5, 14, 1000)
        (100, 1)
    """
    return max(1, -(-(last - first + 1) // max(1, columns)))  # integers: steps reach 2**63 - 1


def _aggregates(metrics: Sequence[str]) -> str:
    """Per metric: the largest magnitude (-1 for no value, NaN when one is NaN), the smallest, the largest value."""
    parts = []
    for i, metric in enumerate(metrics):
        column = identifier(metric)
        parts.append(f"coalesce(max(abs({column})), -1.0) AS high_{i}, coalesce(min(abs({column})), -1.0) AS low_{i}, "
                     f"max({column}) AS top_{i}")
    return ", ".join(parts)


def _cells(result: dict[str, npt.NDArray[Any]], mask: npt.NDArray[np.bool_], i: int, rows: npt.NDArray[np.int64],
           cols: npt.NDArray[np.int64], shape: tuple[int, int]) -> tuple[Floats, Floats, npt.NDArray[np.uint8]]:
    """Scatter one metric's aggregates into ``shape`` arrays: ``(high, low, special)``."""
    high_values = result[f"high_{i}"][mask].astype(np.float64)
    low_values = result[f"low_{i}"][mask].astype(np.float64)
    top = result[f"top_{i}"][mask].astype(np.float64)
    high, low = np.full(shape, np.nan), np.full(shape, np.nan)
    special = np.full(shape, MISSING, np.uint8)
    code = np.zeros(len(high_values), np.uint8)
    code[high_values < 0] = MISSING
    infinite = np.isinf(high_values)
    code[infinite] = np.where(top[infinite] == np.inf, POS_INF, NEG_INF)
    code[np.isnan(high_values)] = NAN
    finite = code == 0
    special[rows, cols] = code
    high[rows[finite], cols[finite]] = high_values[finite]
    low[rows[finite], cols[finite]] = np.where(np.isfinite(low_values[finite]), low_values[finite], high_values[finite])
    return high, low, special


def _compact(buckets: npt.NDArray[np.int64], start: int, width: int, last: int, kind: str) -> tuple[Axis, Any]:
    """The axis of the buckets that hold data and each entry's position on it."""
    present, position = np.unique(buckets, return_inverse=True)
    starts = (start + present * width).tolist()  # numpy: no device
    return Axis(kind, [int(s) for s in starts], width, last), position.reshape(-1).astype(np.int64)


def _row_grids(source: RunSource, view: str, family: str, metrics: Sequence[str], split: str, values: Sequence[int],
               bucket: str, axis_start: int, width: int, axis_last: int, where: str) -> list[Grid]:
    """Grids whose rows are the family's rows, one per value of ``split`` (``rank`` or ``step``) in ``values``."""
    table = source.arrow(
        f"SELECT {split} AS split, vpp_stage, name, {bucket} AS bucket, min(\"order\") AS first, "
        f"{_aggregates(metrics)} FROM {identifier(family)} WHERE {where} GROUP BY ALL")
    names = pc.dictionary_encode(table.column("name").combine_chunks())
    name_codes = names.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    dictionary = names.dictionary.to_pylist()
    result = {column: table.column(column).to_numpy() for column in table.column_names if column != "name"}
    key_codes = result["vpp_stage"].astype(np.int64) * len(dictionary) + name_codes
    grids = []
    for value in values:
        mask = result["split"] == value
        if not mask.any():
            continue
        present, rows = np.unique(key_codes[mask], return_inverse=True)
        rows = rows.reshape(-1).astype(np.int64)
        row_keys = [(int(code // len(dictionary)), str(dictionary[code % len(dictionary)]))
                    for code in present.tolist()]  # numpy: no device
        first_of = np.full(len(row_keys), np.inf)
        np.minimum.at(first_of, rows, result["first"][mask].astype(np.float64))
        axis, cols = _compact(result["bucket"][mask].astype(np.int64), axis_start, width, axis_last, view)
        for i, metric in enumerate(metrics):
            high, low, special = _cells(result, mask, i, rows, cols, (len(row_keys), len(axis.starts)))
            grids.append(Grid("steps" if split == "rank" else "ranks", family, metric, int(value), axis, high, low,
                              special, row_keys, first_of.tolist()))  # numpy: no device
    return grids


def step_grids(source: RunSource, family: str, metrics: Sequence[str], ranks: Sequence[int], first: int, last: int,
               columns: int, history: bool = False) -> list[Grid]:
    """``steps`` grids (module x step) of ``ranks`` (one scan of their rows for all ``metrics``).

    Args:
        first, last: the step range (the family's, or a zoomed range).
        columns: columns at most.
        history: also query the :data:`WINDOW` columns before ``first`` (the running median of a zoomed range;
            :func:`~trainmon.tools.report.colours.encode` with ``first`` drops them).
    """
    width = bucket_width(first, last, columns)
    origin = _origin(source, family, first, width, history)
    rank_list = ", ".join(str(int(r)) for r in ranks)
    return _row_grids(source, "steps", family, metrics, "rank", ranks, f"(step - {origin}) // {width}", origin, width,
                      last, f"rank IN ({rank_list}) AND step BETWEEN {origin} AND {last}")


def _origin(source: RunSource, family: str, first: int, width: int, history: bool) -> int:
    """The first step queried: ``first``, or with ``history`` up to :data:`WINDOW` whole buckets before it."""
    if not history:
        return first
    earliest = max(source.families[family].first_step, first - WINDOW * width)
    return first - (first - earliest) // width * width


def rank_grids(source: RunSource, family: str, metrics: Sequence[str], steps: Sequence[int],
               max_ranks: int = MAX_RANKS) -> list[Grid]:
    """``ranks`` grids (module x rank) at each of ``steps``."""
    ranks = source.families[family].ranks
    width = bucket_width(ranks[0], ranks[-1], max_ranks)
    step_list = ", ".join(str(int(s)) for s in steps)
    return _row_grids(source, "ranks", family, metrics, "step", steps, f"(rank - {ranks[0]}) // {width}", ranks[0],
                      width, ranks[-1], f"step IN ({step_list}){source_filter(source, ' AND ')}")


def module_grids(source: RunSource, family: str, metrics: Sequence[str], modules: Sequence[tuple[int, str]],
                 first: int, last: int, columns: int, max_ranks: int = MAX_RANKS, history: bool = False) -> list[Grid]:
    """``module`` grids (rank x step) of each ``(vpp_stage, name)`` of ``modules`` (``history``: as
    :func:`step_grids`)."""
    ranks = source.families[family].ranks
    width = bucket_width(first, last, columns)
    rank_width = bucket_width(ranks[0], ranks[-1], max_ranks)
    origin = _origin(source, family, first, width, history)
    names = sorted({name for _, name in modules})
    placeholders = ", ".join("?" for _ in names)
    result = source.query(
        f"SELECT vpp_stage, name, (rank - {ranks[0]}) // {rank_width} AS rank_bucket, "
        f"(step - {origin}) // {width} AS bucket, {_aggregates(metrics)} FROM {identifier(family)} "
        f"WHERE name IN ({placeholders}) AND step BETWEEN {origin} AND {last}{source_filter(source, ' AND ')} "
        "GROUP BY ALL", names)
    grids = []
    for vpp, name in modules:
        mask = (result["name"] == name) & (result["vpp_stage"] == vpp)
        if not mask.any():
            continue
        axis, cols = _compact(result["bucket"][mask].astype(np.int64), origin, width, last, "steps")
        rank_axis, rows = _compact(result["rank_bucket"][mask].astype(np.int64), ranks[0], rank_width, ranks[-1],
                                   "ranks")
        for i, metric in enumerate(metrics):
            high, low, special = _cells(result, mask, i, rows, cols, (len(rank_axis.starts), len(axis.starts)))
            grids.append(Grid("module", family, metric, _label(vpp, name), axis, high, low, special,
                              rank_rows=rank_axis, module=(vpp, name)))
    return grids


def _label(vpp: int, name: str) -> str:
    return name if vpp == 0 else f"{name} (vpp {vpp})"


def row_set(grids: Sequence[Grid]) -> RowSet:
    """The rows of a family over ``grids`` (``steps`` and ``ranks``), each at its earliest execution position."""
    first: dict[tuple[int, str], float] = {}
    for grid in grids:
        for key, at in zip(grid.row_keys, grid.row_first):
            first[key] = min(first.get(key, at), at)
    keys = list(first)
    return order_rows(keys, [first[key] for key in keys])


__all__ = ["CHANGE_RANGE", "MAX_RANKS", "WINDOW", "Axis", "Grid", "bucket_width", "module_grids", "rank_grids",
           "row_set", "step_grids"]
