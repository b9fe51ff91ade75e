"""Parquet sink: the run store (``{run}/store/{table}/rank={R}/part-*.parquet``; layout in :mod:`.store_layout`, files
rolled and merged by :mod:`.store_parts`).

Rows are kept in memory per table on the writer thread and rolled into a small Parquet file at most every
``roll_seconds`` (when the :class:`~trainmon.base.threads.OutputThread` flushes), every ``max_rows`` rows, and once
no record came for ``flush_seconds`` (:meth:`ParquetSink.idle`); runs of ``fan_in`` small files are merged into one
larger part, 8 of those into one part of the next level (and so on: :class:`~.store_parts.TableParts`), and at close
the remaining small files are merged too. Each file is written whole under a hidden name and renamed, never over an
existing file, with no symlink followed (:mod:`trainmon.base.safe_io`): a ``kill -9`` leaves every file readable and
loses what was not rolled yet (at most ``roll_seconds`` of rows, or the step being written).

Columns of a row table: ``step`` (int64), ``micro_step``, ``vpp_stage``, ``pp_stage``, ``order`` (int32),
``phase``, ``name`` (dictionary-encoded strings), ``nonfinite`` (bool), then one float64 column per configured
metric. float64 keeps exactly the value the CSV sink writes (its ``repr``); ``mean`` and ``zeros`` are a
float32 sum or count divided by the element count in float64, so float32 columns would round them. The float
columns use the BYTE_STREAM_SPLIT encoding under zstd: the low mantissa bytes of float32-exact values (norm,
min, max) are zeros that compress to nothing, so float64 costs ~3.5 bytes per row more than float32 would.
The ``scalars`` table is ``step`` (int64), ``name`` (dictionary), ``value`` (float64).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from trainmon.base.records import Row, StepRecord
from trainmon.sinks.store_events import store_events
from trainmon.sinks.store_layout import SCALARS, table_dir
from trainmon.sinks.store_parts import TableParts

logger = logging.getLogger("trainmon")


@dataclass
class _Table:
    """Rows of one table not rolled into a file yet: the rows themselves (appending is the writer's hot path;
    they become columns once per file) or, for the scalars, ``(step, name, value)`` triples."""

    metrics: tuple[str, ...]
    rows: list[Row] = field(default_factory=list)
    pp_stages: list[int] = field(default_factory=list)
    scalars: list[tuple[int, str, float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows) + len(self.scalars)

    def step_range(self) -> tuple[int, int]:
        if self.scalars:
            return self.scalars[0][0], self.scalars[-1][0]
        return self.rows[0].step, self.rows[-1].step

    def arrow(self) -> pa.Table:
        if not self.metrics:  # scalars: step, name, value
            steps, names, values = zip(*self.scalars)
            return pa.table({"step": pa.array(steps, pa.int64()), "name": pa.array(names, pa.string()),
                             "value": pa.array(values, pa.float64())})
        rows, keys = self.rows, [row.key for row in self.rows]
        columns: dict[str, Any] = {
            "step": pa.array([row.step for row in rows], pa.int64()),
            "micro_step": pa.array([key.micro_step for key in keys], pa.int32()),
            "vpp_stage": pa.array([key.vpp_stage for key in keys], pa.int32()),
            "pp_stage": pa.array(self.pp_stages, pa.int32()),
            "order": pa.array([key.order for key in keys], pa.int32()),
            "phase": pa.array([key.phase for key in keys], pa.string()),
            "name": pa.array([key.name for key in keys], pa.string()),
            "nonfinite": pa.array([row.nonfinite for row in rows], pa.bool_()),
        }
        matrix = np.array([tuple(row.values.values()) for row in rows], dtype=np.float64)  # one C pass
        for i, metric in enumerate(self.metrics):
            columns[metric] = pa.array(matrix[:, i])
        return pa.table(columns)


class ParquetSink:
    """Writes each family's rows and the scalars of one rank into the run store.

    Args:
        rank_dir: ``{output_dir}/{run_name}/rank{R}`` (the store lives beside it, in ``{run}/store``).
        root: the run directory, below which no symlink is followed (default: ``rank_dir``'s parent).
        roll_seconds: the longest time rows stay in memory only (what a ``kill -9`` can lose).
        max_rows: rows of one table kept in memory before they are rolled whatever the time.
        fan_in: small files merged into one part as soon as there are this many.
        merge_rows: small files merged as soon as they hold this many rows (bounds a merge's memory).
        level_fan_in: merged parts of one level merged into one of the next as soon as there are this many.
        clock: the time source (tests replace it).
    """

    name = "parquet"

    def __init__(self, rank_dir: Path, root: Path | None = None, *, roll_seconds: float = 2.0,
                 max_rows: int = 1 << 18, fan_in: int = 64, merge_rows: int = 1 << 22, level_fan_in: int = 8,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rank_dir = Path(rank_dir)
        self.root = Path(root) if root is not None else self.rank_dir.parent
        self.roll_seconds, self.max_rows, self.fan_in = roll_seconds, max_rows, max(2, fan_in)
        self.merge_rows, self.level_fan_in = merge_rows, level_fan_in
        self.writer_token = os.urandom(4).hex()
        self._clock = clock
        self._last_roll = clock()
        self._rank: int | None = None
        self._tables: dict[str, _Table] = {}
        self._parts: dict[str, TableParts] = {}  # per table: this writer's files (small ones not merged yet)
        self._sequence = itertools.count().__next__  # sequence numbers count every table's files

    # --------------------------------------------------------------------------- writer thread
    def write(self, record: StepRecord) -> None:
        """Append a record's rows and scalars to the in-memory tables (rolled on :meth:`flush`)."""
        if self._rank is None:
            self._rank = record.rank
        step, pp_stage, tables = record.step, record.pp_stage, self._tables
        for row in record.rows:
            values = row.values
            table = tables.get(row.key.family)
            if table is None or table.metrics != tuple(values):
                table = self._start(row.key.family, tuple(values))
            table.rows.append(row)
            table.pp_stages.append(pp_stage)
        if record.scalars:
            table = tables.get(SCALARS) or self._start(SCALARS, ())
            table.scalars.extend((step, name, float(value)) for name, value in record.scalars.items())
        for name, table in list(tables.items()):
            if len(table) >= self.max_rows:
                self._roll(name)

    def _start(self, name: str, metrics: tuple[str, ...]) -> _Table:
        """A new in-memory table; rows of other metrics (a changed config) go to a file of their own first."""
        if name in self._tables:
            self._roll(name)
        table = self._tables[name] = _Table(metrics)
        return table

    def flush(self) -> None:
        """Roll every table into a small file once ``roll_seconds`` have passed since the last roll."""
        now = self._clock()
        if now - self._last_roll >= self.roll_seconds:
            self._roll_all()
            self._last_roll = now

    def idle(self) -> None:
        """Roll what is in memory: nothing came for a while (the writer calls it after ``flush_seconds`` of an
        empty queue), so a crash in a pause of training (an evaluation, a checkpoint) loses nothing."""
        self._roll_all()
        self._last_roll = self._clock()

    def close(self) -> None:
        """Roll what is in memory, merge each table's small files into one part, and store the rank's anomaly
        events not stored yet (``anomalies.jsonl`` is complete by now: the anomaly engine closes first)."""
        self._roll_all()
        for parts in self._parts.values():
            parts.close()
        if self._rank is not None:
            store_events(self.rank_dir, self._rank, self.root)

    # --------------------------------------------------------------------------- files
    def _roll_all(self) -> None:
        for name in list(self._tables):
            self._roll(name)

    def _roll(self, name: str) -> None:
        table = self._tables.get(name)
        if table is None or not len(table):
            return
        self._tables[name] = _Table(table.metrics)
        assert self._rank is not None, "rows come with a record, which names the rank"
        parts = self._parts.get(name)
        if parts is None:
            parts = self._parts[name] = TableParts(table_dir(self.root, name, self._rank), self.root,
                                                   self.writer_token, self._sequence, fan_in=self.fan_in,
                                                   merge_rows=self.merge_rows, level_fan_in=self.level_fan_in)
        parts.add(table.arrow(), *table.step_range())
