"""Which heatmaps the static page of ``trainmon report`` holds, within its size budget (framework-free).

A run of 4,096 ranks x 1,000 tensors x 10 families x 7 metrics has far more grids than a page can hold; the page
keeps the most telling ones first and stops at ``--max-size`` (``trainmon serve`` shows any of them):

1. module x step of the *main rank* (the rank of the first origin, else the lowest) for each family, its default
   metric (``norm``), the default family first (:data:`DEFAULT_FAMILIES`: the reduced gradient, not an optimizer
   state);
2. module x rank at the *key steps* (the first origin, the first non-finite value, the first spike, the largest
   change of the default grid, the last step) and rank x step of the *key rows* (the rows of those events, the
   row that changed most), default family and metric;
3. module x step of other ranks (the ranks with events first, then ranks spread over the run), default family;
4. the other metrics of the main rank; then the key steps and rows of the other families.

Each step is planned from the sizes grids will have (rows x columns, one byte per cell and colour mode) before it
is queried, and the grids of one family and view are queried together (one scan for their ranks, steps or rows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainmon.tools.report.colours import encode, encoded_size, largest_change
from trainmon.tools.report.grids import MAX_RANKS, Grid, bucket_width, module_grids, rank_grids, row_set, step_grids
from trainmon.tools.report.source import RunSource, identifier

DEFAULT_FAMILIES = ("grad_reduced", "grad_unreduced", "actv_grad", "actv", "update", "param", "exp_avg", "ratio",
                    "exp_avg_sq", "momentum", "comm")
"""Families in the order of what they tell when a run goes wrong (the first one present is the default)."""
DEFAULT_METRICS = ("norm", "max", "min", "mean", "nans", "infs", "zeros")
"""Metrics likewise (a metric not listed comes after, in table order)."""
OTHER_RANKS = 7
"""module x step grids of ranks besides the main rank, at most (default family)."""
KEY_ROWS = 4
"""rank x step grids (key rows) per family, at most."""


def ordered_families(families: Sequence[str]) -> list[str]:
    """``families``, the most telling first.

    Example:
        >>> ordered_families(["exp_avg", "actv", "grad_reduced", "zz"])
        ['grad_reduced', 'actv', 'exp_avg', 'zz']
    """
    rank = {family: i for i, family in enumerate(DEFAULT_FAMILIES)}
    return sorted(families, key=lambda f: (rank.get(f, len(rank)), f))


def ordered_metrics(metrics: Sequence[str]) -> list[str]:
    """``metrics``, the most telling first (``norm``), the others in table order."""
    rank = {metric: i for i, metric in enumerate(DEFAULT_METRICS)}
    return sorted(metrics, key=lambda m: (rank.get(m, len(rank)), metrics.index(m)))


@dataclass
class Page:
    """The heatmaps of the page (encoded), the rows of each family and what was left out."""

    grids: list[dict[str, Any]] = field(default_factory=list)
    rowsets: dict[str, dict[str, Any]] = field(default_factory=dict)
    left_out: int = 0
    bytes: int = 0


@dataclass
class _Planner:
    source: RunSource
    metrics_of: dict[str, list[str]]
    main_rank: int
    columns: int
    budget: int
    on_query: Callable[[], None]
    used: int = 0
    left_out: int = 0
    raw: list[Grid] = field(default_factory=list)
    rows_of: dict[str, int] = field(default_factory=dict)

    def take(self, size: int) -> bool:
        if self.used + size > self.budget:
            self.left_out += 1
            return False
        self.used += size
        return True

    def rows(self, family: str) -> int:
        """Rows of ``family`` (its distinct row names at one step of one rank)."""
        if family not in self.rows_of:
            info = self.source.families[family]
            rank = self.main_rank if self.main_rank in info.ranks else info.ranks[0]
            found = self.source.query(
                f"SELECT count(*) AS n FROM (SELECT DISTINCT vpp_stage, name FROM {identifier(family)} WHERE rank = "
                f"{rank} AND step = (SELECT min(step) FROM {identifier(family)} WHERE rank = {rank}))")
            self.rows_of[family] = max(1, int(found["n"][0]))
        return self.rows_of[family]

    def step_columns(self, family: str) -> int:
        info = self.source.families[family]
        width = bucket_width(info.first_step, info.last_step, self.columns)
        return -(-(info.last_step - info.first_step + 1) // width)

    def rank_columns(self, family: str) -> int:
        ranks = self.source.families[family].ranks
        return -(-(ranks[-1] - ranks[0] + 1) // bucket_width(ranks[0], ranks[-1], MAX_RANKS))

    def steps(self, family: str, wanted: list[tuple[int, str]]) -> None:
        """Query the accepted ``(rank, metric)`` module x step grids of ``family``."""
        if not wanted:
            return
        info = self.source.families[family]
        ranks = sorted({rank for rank, _ in wanted})
        metrics = [m for m in self.metrics_of[family] if any(m == w for _, w in wanted)]
        for grid in step_grids(self.source, family, metrics, ranks, info.first_step, info.last_step, self.columns):
            if (grid.at, grid.metric) in wanted:
                self.raw.append(grid)
        self.on_query()

    def at_steps(self, family: str, metric: str, steps: list[int]) -> None:
        size = encoded_size(self.rows(family), self.rank_columns(family))
        chosen = [step for step in steps if self.take(size)]
        if chosen:
            self.raw += rank_grids(self.source, family, [metric], chosen)
            self.on_query()

    def of_rows(self, family: str, metric: str, modules: list[tuple[int, str]]) -> None:
        size = encoded_size(self.rank_columns(family), self.step_columns(family))
        chosen = [module for module in modules if self.take(size)]
        if chosen:
            info = self.source.families[family]
            self.raw += module_grids(self.source, family, [metric], chosen, info.first_step, info.last_step,
                                     self.columns)
            self.on_query()


def plan_page(source: RunSource, metrics_of: dict[str, list[str]], main_rank: int, anomalies: dict[str, Any],
              columns: int, budget: int, on_query: Callable[[], None] = lambda: None) -> Page:
    """Query and encode the grids the page holds.

    Args:
        source: the run.
        metrics_of: the metrics shown of each family (``--metrics`` applied), the default first.
        main_rank: the rank shown first.
        anomalies: the page's anomalies (``first_origin``, ``first_nonfinite``, ``first_spike``, ``timeline``).
        columns: step columns at most.
        budget: bytes of encoded grids at most.
        on_query: called after each query (a progress bar).
    """
    families = ordered_families([f for f in metrics_of if metrics_of[f]])
    planner = _Planner(source, metrics_of, main_rank, columns, budget, on_query)
    if not families:
        return Page()
    default = families[0]
    # 1. the main rank, every family's default metric
    first: dict[str, list[tuple[int, str]]] = {}
    for family in families:
        rank = main_rank if main_rank in source.families[family].ranks else source.families[family].ranks[0]
        if planner.take(encoded_size(planner.rows(family), planner.step_columns(family))):
            first[family] = [(rank, metrics_of[family][0])]
    for family, wanted in first.items():
        planner.steps(family, wanted)
    main_grids = {grid.family: grid for grid in planner.raw}
    # 2. key steps and rows of the default family
    metric = metrics_of[default][0]
    key_steps, key_rows = _keys(source, default, metric, main_grids.get(default), anomalies)
    planner.at_steps(default, metric, key_steps)
    planner.of_rows(default, metric, key_rows)
    # 3. other ranks, default family and metric
    others = _other_ranks(source.families[default].ranks, main_rank, anomalies)
    size = encoded_size(planner.rows(default), planner.step_columns(default))
    planner.steps(default, [(rank, metric) for rank in others if planner.take(size)])
    # 4. the other metrics of the main rank; the key steps and rows of the other families
    for family in families:
        rank = main_rank if main_rank in source.families[family].ranks else source.families[family].ranks[0]
        size = encoded_size(planner.rows(family), planner.step_columns(family))
        planner.steps(family, [(rank, m) for m in metrics_of[family][1:] if planner.take(size)])
    for family in families[1:]:
        steps, rows = _keys(source, family, metrics_of[family][0], main_grids.get(family), anomalies)
        planner.at_steps(family, metrics_of[family][0], steps)
        planner.of_rows(family, metrics_of[family][0], rows)
    return _encode(planner)


def _encode(planner: _Planner) -> Page:
    page = Page(left_out=planner.left_out)
    by_family: dict[str, list[Grid]] = {}
    for grid in planner.raw:
        if grid.view != "module":
            by_family.setdefault(grid.family, []).append(grid)
    rowsets = {family: row_set(grids) for family, grids in by_family.items()}
    page.rowsets = {family: rows.to_json() for family, rows in rowsets.items()}
    for grid in planner.raw:
        encoded = encode(grid.reordered(rowsets[grid.family]) if grid.view != "module" else grid)
        page.grids.append(encoded)
        page.bytes += len(encoded["abs"]["data"]) + len(encoded["change"]["data"])
    return page


def _keys(source: RunSource, family: str, metric: str, grid: Grid | None,
          anomalies: dict[str, Any]) -> tuple[list[int], list[tuple[int, str]]]:
    """The key steps and rows of a family: its events' and its largest change's, and its last step."""
    info = source.families[family]
    steps: list[int] = []
    rows: list[tuple[int, str]] = []
    names = set(grid.row_keys) if grid is not None else set()
    for which in ("first_origin", "first_nonfinite", "first_spike"):
        event = anomalies.get(which)
        if not event or (source.ranks is not None and event.get("rank") not in source.ranks):
            continue
        steps.append(int(event["step"]))
        if event.get("family") == family:
            event_row = (int(event.get("vpp_stage") or 0), str(event.get("name")))
            if event_row in names:
                rows.append(event_row)
    if grid is not None:
        found = largest_change(grid)
        if found is not None:
            row, col, decades = found
            key = grid.row_keys[row]
            start = grid.cols.starts[col]
            result = source.query(
                f"SELECT step FROM {identifier(family)} WHERE rank = ? AND vpp_stage = ? AND name = ? AND step BETWEEN "
                f"? AND ? AND isfinite({identifier(metric)}) ORDER BY abs({identifier(metric)}) "
                f"{'DESC' if decades > 0 else 'ASC'}, step LIMIT 1",
                [int(grid.at), key[0], key[1], start, start + grid.cols.width - 1])
            if len(result["step"]):
                steps.append(int(result["step"][0]))
            rows.append(key)
    steps.append(info.last_step)
    present = set(_collected(source, family, steps))
    return ([s for s in dict.fromkeys(steps) if s in present],
            list(dict.fromkeys(rows))[:KEY_ROWS])


def _collected(source: RunSource, family: str, steps: list[int]) -> list[int]:
    """Those of ``steps`` that the family has rows at."""
    if not steps:
        return []
    found = source.query(f"SELECT DISTINCT step FROM {identifier(family)} WHERE step IN "
                         f"({', '.join(str(int(s)) for s in steps)})")
    return [int(s) for s in found["step"]]


def _other_ranks(ranks: list[int], main_rank: int, anomalies: dict[str, Any]) -> list[int]:
    """Ranks besides the main one: those with events (earliest first), then ranks spread evenly over the run."""
    cells = anomalies.get("timeline", {}).get("cells", [])
    with_events = [rank for rank, _, _ in sorted(cells, key=lambda cell: (cell[1], cell[0]))]
    spread = [ranks[int(i)] for i in np.linspace(0, len(ranks) - 1, num=min(len(ranks), OTHER_RANKS + 1))]
    chosen = [r for r in dict.fromkeys(with_events + spread) if r != main_rank and r in set(ranks)]
    return chosen[:OTHER_RANKS]


__all__ = ["DEFAULT_FAMILIES", "DEFAULT_METRICS", "Page", "ordered_families", "ordered_metrics", "plan_page"]
