"""The SQL that the analyses of a run's store share (DuckDB, embedded): :func:`connect`, quoting, the earliest-first
order (:data:`ORDER_KEY`) and the ``WHERE`` of the selected steps (:class:`StepFilter`); used by
:mod:`trainmon.tools.store_analyse`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import duckdb
import pyarrow as pa

from trainmon.anomaly.ordering import PHASE_RANK
from trainmon.anomaly.step_ranges import StepRanges

_MAX_INLINE_RANGES = 64


def phase_rank(column: str = "phase") -> str:
    """A SQL expression of the rank of the phase in ``column`` (:data:`trainmon.anomaly.ordering.PHASE_RANK`; an
    unknown phase after all of them)."""
    cases = " ".join(f"WHEN '{phase}' THEN {rank}" for phase, rank in PHASE_RANK.items())
    return f"CASE {column} {cases} ELSE {len(PHASE_RANK)} END"


ORDER_KEY = (f"step, micro_step, {phase_rank()}, CASE WHEN phase = 'backward' THEN -vpp_stage ELSE vpp_stage END, "
             "CASE WHEN phase = 'backward' THEN -pp_stage ELSE pp_stage END, \"order\", rank")
"""The earliest-first sort key in SQL (:func:`trainmon.anomaly.ordering.sort_key_fields`)."""


def identifier(text: str) -> str:
    """``text`` as a quoted SQL identifier (a table, view or column name)."""
    return '"' + text.replace('"', '""') + '"'


def literal(text: str) -> str:
    """``text`` as a quoted SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


@contextmanager
def connect() -> Iterator[duckdb.DuckDBPyConnection]:
    """An in-memory DuckDB connection that draws no progress bar and spills to a temporary folder of its own
    (DuckDB's default is ``.tmp`` in the working directory), removed on exit."""
    with tempfile.TemporaryDirectory(prefix="trainmon-duckdb-") as spill:
        con = duckdb.connect()
        try:
            con.execute("SET enable_progress_bar = false")
            con.execute(f"SET temp_directory = {literal(spill)}")
            yield con
        finally:
            con.close()


class StepFilter:
    """The ``WHERE`` of the selected steps (and detectors): inline ranges, or a temporary table of many ranges."""

    def __init__(self, con: duckdb.DuckDBPyConnection, steps: StepRanges | None) -> None:
        self.steps = "TRUE"
        if steps is None:
            return
        if not steps.ranges:
            self.steps = "FALSE"
        elif len(steps.ranges) <= _MAX_INLINE_RANGES:
            self.steps = "(" + " OR ".join(f"step BETWEEN {low} AND {high}" for low, high in steps.ranges) + ")"
        else:
            lows, highs = zip(*steps.ranges)
            ranges = pa.table({"low": pa.array(lows, pa.int64()), "high": pa.array(highs, pa.int64())})
            con.register("_trainmon_ranges", ranges)
            con.execute("CREATE OR REPLACE TEMP TABLE _trainmon_steps AS SELECT * FROM _trainmon_ranges")
            con.unregister("_trainmon_ranges")
            self.steps = "EXISTS (SELECT 1 FROM _trainmon_steps WHERE step BETWEEN low AND high)"


__all__ = ["ORDER_KEY", "StepFilter", "connect", "identifier", "literal", "phase_rank"]
