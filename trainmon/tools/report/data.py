"""What ``trainmon report`` reads besides the statistics' heatmaps and curves (framework-free): the run's sources
(CSV files and store families per rank), the anomaly timeline and markers (from ``analyse``'s merge,
:func:`trainmon.anomaly.merge.analyse_run`) and the grad probe's direction heatmaps.

The grad-probe heatmaps are parameter x step grids, one per (rank, metric), with at most ``max_columns``
columns: when a run has more collected steps, each column is a bin of consecutive collected steps and a cell
holds the lowest value of the bin (a drop of agreement stays visible). Cells are sent as one byte each: the
value quantised to 250 levels on the metric's fixed range, plus codes for NaN, +Inf, -Inf and missing. (The
statistics' heatmaps and curves are queried with SQL: :mod:`trainmon.tools.report.grids`.)
"""

from __future__ import annotations

import base64
import csv
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from trainmon.base.inputs import open_regular
from trainmon.sinks.store_replicas import ranks_text
from trainmon.tools.csv2tb_sources import rank_dirs
from trainmon.tools.readers import CsvFormatError, Table
from trainmon.tools.report.grids import LEVELS, MISSING, NAN, NEG_INF, POS_INF, log_levels
from trainmon.tools.store_reader import Source, StoreError, with_store

Ints: TypeAlias = "npt.NDArray[np.int64]"
"""Steps, bins and flat cell indices."""
PROBE_METRICS = {"sign_agree_prev": (0.0, 1.0), "sign_agree_exp_avg": (0.0, 1.0), "cos_prev": (-1.0, 1.0),
                 "cos_exp_avg": (-1.0, 1.0)}
"""grad_probe summary columns drawn as direction-similarity heatmaps, with their fixed colour range."""
_RANK = re.compile(r"rank(\d+)")


def rank_of(folder: Path, default: int) -> int:
    """``rank3`` or msprobe's ``{time}-rank3-{id}`` -> 3."""
    match = _RANK.search(folder.name)
    return int(match.group(1)) if match else default


def sources(run_dir: Path) -> dict[int, list[Source]]:
    """``rank -> CSV files`` of a run (trainmon or msprobe layout; see :func:`trainmon.tools.csv2tb_sources.rank_dirs`),
    with the families of the run's store that have no CSV file (:func:`trainmon.tools.store_reader.with_store`).

    Raises:
        FileNotFoundError: not a run directory.
        StoreError: the store cannot be listed.
    """
    out: dict[int, list[Path]] = {}
    for i, folder in enumerate(rank_dirs(run_dir)):
        out.setdefault(rank_of(folder, i), []).extend(sorted(folder.glob("*.csv")))
    return with_store(run_dir, out)


def probe_files(run_dir: Path, ranks: list[int]) -> dict[int, Path]:
    """``rank -> rank{R}/grad_probe/grad_summary.csv`` where it exists (``grad_probe/`` of a rank directory), else
    the rank's folder of the store's ``grad_probe`` table (:func:`probe_store_folders`)."""
    found = {}
    for rank in ranks:
        for folder in (run_dir / f"rank{rank}", run_dir):  # a run, or one rank directory
            path = folder / "grad_probe" / "grad_summary.csv"
            if path.is_file() and (folder != run_dir or rank_of(run_dir, -1) == rank):
                found[rank] = path
                break
    return {**probe_store_folders(run_dir, [rank for rank in ranks if rank not in found]), **found}


def probe_store_folders(run_dir: Path, ranks: list[int]) -> dict[int, Path]:
    """``rank -> store/grad_probe/rank={R}`` of the ranks whose grad probe wrote into the run store."""
    from trainmon.probe.store import stored_ranks
    from trainmon.sinks.store_layout import GRAD_PROBE, table_dir

    try:
        stored = stored_ranks(run_dir, GRAD_PROBE)
    except OSError as exc:
        raise StoreError(f"{run_dir}: cannot list the store ({exc.strerror or exc})") from None
    return {rank: table_dir(run_dir, GRAD_PROBE, rank) for rank in ranks if rank in stored}


def read_probe_store(folder: Path) -> Table:
    """A rank's ``grad_probe`` store table (``store/grad_probe/rank={R}``) as :func:`read_probe_table` reads
    ``grad_summary.csv``: a :class:`~trainmon.tools.readers.Table` of its similarity columns.

    Raises:
        StoreError: a part that is not a readable grad-probe part (the file in the message).
    """
    from trainmon.base.inputs import is_dir
    from trainmon.probe.storage import SIMILARITIES, DirectionFormatError
    from trainmon.probe.store import read_summary
    from trainmon.sinks.store_layout import live_parts

    try:
        parts = [part.path for part in live_parts(sorted(folder.iterdir()))] if is_dir(folder) else []
        table = read_summary(parts, ["vpp_stage", "name", "step", *PROBE_METRICS])
    except DirectionFormatError as exc:
        raise StoreError(str(exc)) from None
    metrics = [name for name in SIMILARITIES if name in PROBE_METRICS and name in table.column_names]  # CSV order
    index: dict[tuple[int, str], int] = {}
    rows = [index.setdefault(key, len(index)) for key in zip(table.column("vpp_stage").to_pylist(),
                                                              table.column("name").to_pylist())]
    values = [table.column(name).to_numpy(zero_copy_only=False).astype(np.float64) for name in metrics]
    return Table("grad_probe", metrics, list(index), np.array(rows, dtype=np.int32),
                 table.column("step").to_numpy(zero_copy_only=False).astype(np.int64), np.zeros(len(rows), np.int32),
                 np.stack(values, axis=1) if values else np.zeros((len(rows), 0)))


def step_bins(steps: Ints, max_columns: int) -> tuple[Ints, Ints, int]:
    """``(bin of each entry, first step of each bin, steps per bin)`` over the distinct sorted ``steps``."""
    low, high = (int(steps.min()), int(steps.max())) if len(steps) else (0, -1)
    if high - low < 8 * len(steps) + 1_000_000:  # one pass over a step range that is not sparse, no sort
        seen = np.zeros(high - low + 1, bool)
        seen[steps - low] = True
        distinct = np.flatnonzero(seen) + low
        position = (np.cumsum(seen) - 1)[steps - low]
    else:
        distinct, position = np.unique(steps, return_inverse=True)
    per_bin = max(1, math.ceil(len(distinct) / max_columns))
    bins = position // per_bin
    return bins, distinct[::per_bin], per_bin


def encode_grid(cells: Ints, shape: tuple[int, int], values: npt.NDArray[np.float64],
                scale: tuple[float, float] | None = None, reduce: str = "absmax") -> dict[str, Any]:
    """One heatmap: the byte codes of a ``shape`` grid from flat cell indices and their values.

    Args:
        cells: flat index of each value in the grid.
        values: the values (NaN/Inf allowed).
        scale: a fixed linear colour range (grad-probe similarities); None: log10 of the magnitude,
            from the grid's own smallest to largest non-zero magnitude.
        reduce: ``absmax`` (largest magnitude in a cell) or ``min`` (the lowest value: a drop of a
            similarity stays visible).

    Returns:
        ``{"lo", "hi", "scale": "log"|"linear", "data": base64 bytes}``.
    """
    size = shape[0] * shape[1]
    nan = np.zeros(size, bool)
    pos_inf = np.zeros(size, bool)
    neg_inf = np.zeros(size, bool)
    nan[cells[np.isnan(values)]] = True
    pos_inf[cells[values == np.inf]] = True
    neg_inf[cells[values == -np.inf]] = True
    finite = np.isfinite(values)
    best = np.full(size, np.nan)
    if reduce == "min":
        best[:] = np.inf
        np.minimum.at(best, cells[finite], values[finite])
        seen = np.isfinite(best)
    else:
        best[:] = -1.0
        np.maximum.at(best, cells[finite], np.abs(values[finite]))
        seen = best >= 0
    codes = np.full(size, MISSING, np.uint8)
    if scale is not None:
        lo, hi = scale
        level = (best[seen] - lo) / (hi - lo)
        codes[seen] = np.clip(np.rint(level * (LEVELS - 1)), 0, LEVELS - 1)
    else:
        lo, hi = log_levels(codes, best, seen)
    codes[neg_inf] = NEG_INF
    codes[pos_inf] = POS_INF
    codes[nan] = NAN
    return {"lo": lo, "hi": hi, "scale": "linear" if scale is not None else "log",
            "nonfinite": int((nan | pos_inf | neg_inf).sum()),
            "data": base64.b64encode(codes.tobytes()).decode("ascii")}


def _label(key: tuple[int, str]) -> str:
    return key[1] if key[0] == 0 else f"{key[1]} (vpp {key[0]})"


def merge_tables(tables: list[Table]) -> tuple[list[tuple[int, str]], dict[str, tuple[npt.NDArray[Any], ...]]]:
    """Tables of one family (rotated files, a metric change) -> row keys and ``metric -> (rows, steps, values)``."""
    keys: dict[tuple[int, str], int] = {}
    by_metric: dict[str, list[tuple[npt.NDArray[Any], ...]]] = {}
    for table in tables:
        remap = np.array([keys.setdefault(key, len(keys)) for key in table.keys], dtype=np.int32)
        rows = remap[table.rows] if len(table.rows) else table.rows
        for column, metric in enumerate(table.metrics):
            by_metric.setdefault(metric, []).append((rows, table.steps, table.values[:, column]))
    # one part (a single file): views, so that every metric shares one steps array (binned once)
    merged = {metric: parts[0] if len(parts) == 1 else tuple(np.concatenate(part) for part in zip(*parts))
              for metric, parts in by_metric.items()}
    return list(keys), merged


def heatmaps(family: str, tables: list[Table], rank: int, max_columns: int,
             scales: dict[str, tuple[float, float]] | None = None,
             metrics: list[str] | None = None, for_ranks: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """The heatmaps of one family on one rank, one per metric (only ``metrics`` when given; with
    ``scales``: only those metrics, on a fixed linear range, lowest value per cell). ``for_ranks``: the ranks whose
    rows these are (a family written once per data-parallel group: the group), shown beside the rank."""
    keys, by_metric = merge_tables(tables)
    out = []
    cells_of: dict[int, tuple[Ints, Ints, int]] = {}  # id(steps) -> cells, first steps, per bin
    for metric, (rows, steps, values) in by_metric.items():
        if (scales is not None and metric not in scales) or (metrics is not None and metric not in metrics):
            continue
        if not len(steps):
            continue
        if id(steps) not in cells_of:
            bins, first_steps, per_bin = step_bins(steps, max_columns)
            cells_of[id(steps)] = rows.astype(np.int64) * len(first_steps) + bins, first_steps, per_bin
        cells, first_steps, per_bin = cells_of[id(steps)]
        shape = (len(keys), len(first_steps))
        scale = scales[metric] if scales is not None else None
        grid = encode_grid(cells, shape, values, scale, "min" if scales is not None else "absmax")
        out.append({"family": family, "metric": metric, "rank": rank, "rows": [_label(k) for k in keys],
                    "steps": first_steps.tolist(), "last_step": int(steps.max()), "per_bin": per_bin,  # numpy: no sync
                    "reduce": "min" if scales is not None else "absmax", **grid,
                    **({"for_ranks": ranks_text(for_ranks)} if for_ranks else {})})
    return out


TIMELINE_ROWS = 160
"""Rows of the anomaly timeline at most: more ranks are binned (consecutive ranks per row)."""


def timeline(result: dict[str, Any], max_columns: int) -> dict[str, Any]:
    """The cross-rank anomaly timeline from :func:`~trainmon.anomaly.merge.analyse_run`'s
    ``by_rank_step`` counts: ``[rank, first step of the bin, events]``, steps binned to ``max_columns``, ranks to
    :data:`TIMELINE_ROWS` rows (``per_rank`` consecutive ranks each, a cell's rank the first of its row)."""
    cells = result["counts"].get("by_rank_step", [])
    if not cells:
        return {"cells": [], "per_bin": 1, "per_rank": 1}
    array = np.array(cells, dtype=np.int64)
    bins, first_steps, per_bin = step_bins(array[:, 1], max_columns)
    ranks = np.unique(array[:, 0])
    per_rank = max(1, math.ceil((int(ranks[-1]) - int(ranks[0]) + 1) / TIMELINE_ROWS))
    rows = (array[:, 0] - ranks[0]) // per_rank * per_rank + ranks[0]
    keyed: dict[tuple[int, int], int] = {}
    for rank, step_bin, count in zip(rows.tolist(), bins.tolist(), array[:, 2].tolist()):  # numpy, no sync
        keyed[(rank, int(first_steps[step_bin]))] = keyed.get((rank, int(first_steps[step_bin])), 0) + count
    return {"cells": [[rank, step, count] for (rank, step), count in sorted(keyed.items())], "per_bin": per_bin,
            "per_rank": per_rank}


def markers(events: list[dict[str, Any]], limit: int = 2000) -> list[dict[str, Any]]:
    """The earliest event of each step (``first_by_step``) as curve and heatmap markers, at most ``limit``
    (evenly thinned beyond)."""
    every = max(1, math.ceil(len(events) / limit))
    return [{"step": e["step"], "rank": e["rank"], "detector": e["detector"], "message": e["message"],
             "family": e.get("family"), "name": e.get("name"), "vpp_stage": e.get("vpp_stage", 0),
             "metric": e.get("metric"), "micro_step": e.get("micro_step", 0)} for e in events[::every]]


def read_probe_table(path: Path) -> Table:
    """``grad_probe/grad_summary.csv`` as a :class:`~trainmon.tools.readers.Table` of its similarity columns (a
    folder of the store: :func:`read_probe_store`)."""
    if path.is_dir():
        return read_probe_store(path)
    try:
        with open_regular(path, text=True, newline="") as handle:
            reader = csv.reader(handle)
            header = next(reader, [])
            if header[:3] != ["vpp_stage", "name", "step"]:
                raise CsvFormatError(f"{path}:1: expected header to start with vpp_stage,name,step, "
                                     f"got {','.join(header)[:80]!r}")
            columns = [i for i, name in enumerate(header) if name in PROBE_METRICS]
            index: dict[tuple[int, str], int] = {}
            rows, steps, values = [], [], []
            for line, row in enumerate(reader, 2):
                if len(row) != len(header):
                    raise CsvFormatError(f"{path}:{line}: expected {len(header)} fields, got {len(row)}")
                try:
                    key = (int(row[0]), row[1])
                    steps.append(int(row[2]))
                    values.append([float(row[i]) for i in columns])
                except ValueError as exc:
                    raise CsvFormatError(f"{path}:{line}: {exc}") from None
                rows.append(index.setdefault(key, len(index)))
    except UnicodeDecodeError as exc:
        raise CsvFormatError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except csv.Error as exc:
        raise CsvFormatError(f"{path}: {exc}") from None
    return Table("grad_probe", [header[i] for i in columns], list(index), np.array(rows, dtype=np.int32),
                 np.array(steps, dtype=np.int64), np.zeros(len(rows), np.int32),
                 np.array(values, dtype=np.float64).reshape(len(rows), len(columns)))
