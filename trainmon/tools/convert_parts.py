"""The rows of one CSV file as a part of the run store, for ``trainmon convert`` (:mod:`trainmon.tools.convert`).

:func:`rows_part` and :func:`scalars_part` turn a block of a trainmon CSV file into the columns the Parquet sink
writes, :func:`msprobe_part` a msprobe CSV file; what a CSV does not hold is filled in as the command's module says
(``phase``, ``order`` by :class:`OrderCounter`, ``pp_stage``, ``nonfinite``).
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from trainmon.base.inputs import open_regular
from trainmon.base.records import PHASE_OF_FAMILY
from trainmon.tools.msprobe_output import layout_of, msprobe_rows
from trainmon.tools.readers import MAX_FIELD, CsvFormatError, Table


class OrderCounter:
    """Each row's position among its file's rows of the same (step, micro-step), carried from block to block."""

    def __init__(self) -> None:
        self.last: tuple[int, int] | None = None
        self.next = 0

    def orders(self, steps: npt.NDArray[np.int64], micro_steps: npt.NDArray[Any]) -> npt.NDArray[np.int32]:
        """The ``order`` of each row of the next block (``steps`` and ``micro_steps`` of its rows, in file order)."""
        count = len(steps)
        starts = np.empty(count, dtype=bool)
        starts[0] = self.last != (int(steps[0]), int(micro_steps[0]))
        starts[1:] = (steps[1:] != steps[:-1]) | (micro_steps[1:] != micro_steps[:-1])
        index = np.arange(count)
        orders = index - np.maximum.accumulate(np.where(starts, index, 0))
        if not starts[0]:  # the block goes on with the last (step, micro-step) of the one before
            orders[: int(np.argmax(starts)) if starts.any() else count] += self.next
        self.next = int(orders[-1]) + 1
        self.last = (int(steps[-1]), int(micro_steps[-1]))
        return np.asarray(orders, dtype=np.int32)


def _nonfinite(values: npt.NDArray[np.float64], metrics: list[str]) -> npt.NDArray[np.bool_]:
    """A row held a NaN or Inf: one of its values is not finite, or its ``nans``/``infs`` count is above 0."""
    flag = ~np.isfinite(values).all(axis=1) if values.shape[1] else np.zeros(len(values), dtype=bool)
    for i, metric in enumerate(metrics):
        if metric in ("nans", "infs"):
            flag |= values[:, i] > 0
    return np.asarray(flag)


def rows_part(block: Table, counter: OrderCounter) -> pa.Table:
    """A block of a trainmon family's CSV file as the store's columns of that family (``order`` from ``counter``)."""
    names = np.array([name for _, name in block.keys], dtype=object)
    vpp = np.array([vpp for vpp, _ in block.keys], dtype=np.int32)
    columns: dict[str, Any] = {
        "step": pa.array(block.steps, pa.int64()),
        "micro_step": pa.array(block.micro_steps, pa.int32()),
        "vpp_stage": pa.array(vpp[block.rows], pa.int32()),
        "pp_stage": pa.array(np.zeros(len(block.steps), np.int32)),
        "order": pa.array(counter.orders(block.steps, block.micro_steps)),
        "phase": pa.array([PHASE_OF_FAMILY[block.family]] * len(block.steps), pa.string()),
        "name": pa.array(names[block.rows], pa.string()),
        "nonfinite": pa.array(_nonfinite(block.values, block.metrics)),
    }
    for i, metric in enumerate(block.metrics):
        columns[metric] = pa.array(np.ascontiguousarray(block.values[:, i]), pa.float64())
    return pa.table(columns)


def scalars_part(block: Table) -> pa.Table:
    """A block of a ``scalars.csv`` as the store's ``scalars`` columns (``step``, ``name``, ``value``)."""
    names = np.array([name for _, name in block.keys], dtype=object)
    return pa.table({"step": pa.array(block.steps, pa.int64()), "name": pa.array(names[block.rows], pa.string()),
                     "value": pa.array(np.ascontiguousarray(block.values[:, 0]), pa.float64())})


def msprobe_part(path: Path, family: str) -> pa.Table:
    """A msprobe CSV file as store rows (see :mod:`trainmon.tools.convert`).

    Raises:
        CsvFormatError: a malformed file (file and line named).
    """
    rows: list[tuple[int, int, int, str, dict[str, float]]] = []  # step, micro-step, vpp stage, name, values
    metrics: dict[str, None] = {}
    try:
        with open_regular(path, text=True, newline="") as handle:
            reader = csv.reader(handle)
            header = next(reader, None)
            if header is None:
                raise CsvFormatError(f"{path}: empty file (no header)")
            if layout_of(header) is None:
                raise CsvFormatError(f"{path}:1: not a msprobe header: {','.join(header)[:80]!r}")
            for line, row in enumerate(reader, 2):
                rows += _msprobe_row(path, line, header, row, family, metrics)
    except UnicodeDecodeError as exc:
        raise CsvFormatError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except csv.Error as exc:
        raise CsvFormatError(f"{path}: {exc}") from None
    if not rows:
        raise CsvFormatError(f"{path}: no rows")
    steps = np.array([r[0] for r in rows], dtype=np.int64)
    micro_steps = np.array([r[1] for r in rows], dtype=np.int32)
    values = np.array([[r[4].get(m, np.nan) for m in metrics] for r in rows], dtype=np.float64)
    present = np.array([[m in r[4] for m in metrics] for r in rows], dtype=bool).reshape(len(rows), len(metrics))
    flag = _nonfinite(np.where(present, values, 0.0), list(metrics))
    columns: dict[str, Any] = {
        "step": pa.array(steps), "micro_step": pa.array(micro_steps),
        "vpp_stage": pa.array(np.array([r[2] for r in rows], dtype=np.int32)),
        "pp_stage": pa.array(np.zeros(len(rows), np.int32)),
        "order": pa.array(OrderCounter().orders(steps, micro_steps)),
        "phase": pa.array([PHASE_OF_FAMILY.get(family, "optimizer")] * len(rows), pa.string()),
        "name": pa.array([r[3] for r in rows], pa.string()),
        "nonfinite": pa.array(flag),
    }
    for i, metric in enumerate(metrics):
        columns[metric] = pa.array(values[:, i], pa.float64(), mask=~present[:, i])
    return pa.table(columns)


def _msprobe_row(path: Path, line: int, header: list[str], row: list[str], family: str,
                 metrics: dict[str, None]) -> Iterator[tuple[int, int, int, str, dict[str, float]]]:
    """The store rows of one msprobe CSV row (1.2 activations: one per input and output)."""
    if len(row) != len(header):
        raise CsvFormatError(f"{path}:{line}: expected {len(header)} fields, got {len(row)}")
    if row and max(map(len, row)) > MAX_FIELD:
        raise CsvFormatError(f"{path}:{line}: a field longer than {MAX_FIELD} characters")
    columns = dict(zip(header, row))
    try:
        step = _integer(columns["step"], "step", (1 << 63) - 1)
        vpp_stage = _integer(columns.get("vpp_stage", "0"), "vpp_stage", 2**31 - 1)
        if "micro_step" in columns:
            micro_step = _integer(columns["micro_step"], "micro_step", 2**31 - 1)
        else:  # msprobe 1.2: "{module}_{micro_step}"
            suffix = re.search(r"_(\d{1,9})$", columns.get("module_name", ""))
            micro_step = int(suffix.group(1)) if suffix else 0
        by_name: dict[str, dict[str, float]] = {}
        for name, metric, text, _ in msprobe_rows(header, row, family):
            by_name.setdefault(name, {})[metric] = float(text)
            metrics.setdefault(metric)
    except (ValueError, KeyError) as exc:
        raise CsvFormatError(f"{path}:{line}: {exc}") from None
    for name, values in by_name.items():
        yield step, micro_step, vpp_stage, name, values


def _integer(text: str, column: str, largest: int) -> int:
    digits = text.strip()
    if not digits.isdigit() or len(digits) > 19 or int(digits) > largest:
        raise ValueError(f"{column} must be an integer in 0..{largest}, got {text[:30]!r}")
    return int(digits)


__all__ = ["OrderCounter", "msprobe_part", "rows_part", "scalars_part"]
