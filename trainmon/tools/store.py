"""Reading a run's store with DuckDB: :func:`open_run` gives a connection with one view per table.

Views (each with a ``rank`` column, from the ``rank={R}`` partition of its files):

- one per family written (``actv``, ``actv_grad``, ``grad_unreduced``, ``grad_reduced``, ``exp_avg``, ...):
  ``step, micro_step, vpp_stage, pp_stage, order, phase, name, nonfinite`` and one DOUBLE column per metric;
- ``scalars``: ``step, name, value``;
- ``anomalies``: every rank's ``anomalies.jsonl`` (the fields of :class:`~trainmon.anomaly.events.AnomalyEvent`;
  NaN and Inf as DOUBLE values), empty when no event was written.

Example:
    >>> con = open_run("trainmon_output/run")  # doctest: +SKIP
    >>> con.sql("SELECT rank, step, name FROM grad_reduced WHERE nonfinite LIMIT 5").df()  # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from trainmon.anomaly.events import AnomalyEvent
from trainmon.anomaly.merge import find_files
from trainmon.base.inputs import is_dir, open_regular
from trainmon.sinks.store_layout import STORE_DIR, live_parts

ANOMALIES = "anomalies"
"""The view of the run's anomaly events."""
_ANOMALY_SCHEMA = pa.schema([
    ("step", pa.int64()), ("micro_step", pa.int32()), ("rank", pa.int64()), ("phase", pa.string()),
    ("pp_stage", pa.int32()), ("vpp_stage", pa.int32()), ("order", pa.int32()), ("detector", pa.string()),
    ("family", pa.string()), ("name", pa.string()), ("metric", pa.string()), ("value", pa.float64()),
    ("baseline", pa.float64()), ("message", pa.string()), ("time", pa.string())])


class StoreError(ValueError):
    """A run directory without a store, or a store that cannot be read; the message names the path."""


def table_files(run_dir: str | os.PathLike[str]) -> dict[str, list[Path]]:
    """The live Parquet parts of each table of a run's store (every rank), by table name.

    Raises:
        StoreError: ``run_dir`` has no ``store/`` folder.
    """
    store = Path(run_dir) / STORE_DIR
    if not is_dir(store):
        raise StoreError(f"{run_dir} has no {STORE_DIR}/ folder (a run written with sinks: [parquet] has one)")
    tables: dict[str, list[Path]] = {}
    for table in sorted(store.iterdir()):
        if not is_dir(table) or table.name.startswith((".", "_")):
            continue
        files: list[Path] = []
        for rank_dir in sorted(table.glob("rank=*")):
            if is_dir(rank_dir):
                files += [part.path for part in live_parts(sorted(rank_dir.iterdir()))]
        if files:
            tables[table.name] = files
    return tables


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _identifier(text: str) -> str:
    return '"' + text.replace('"', '""') + '"'


def read_anomalies(run_dir: str | os.PathLike[str]) -> pa.Table:
    """Every rank's ``anomalies.jsonl`` as one Arrow table (lines that are not events are skipped: a line
    cut short by a crash)."""
    columns: dict[str, list[Any]] = {name: [] for name in _ANOMALY_SCHEMA.names}
    for path in find_files(Path(run_dir)):
        with open_regular(path, text=True) as handle:
            for line in handle:
                try:
                    event = AnomalyEvent.from_json(line)
                except (ValueError, RecursionError):
                    continue
                for name, values in columns.items():
                    values.append(getattr(event, name))
    return pa.table(columns, schema=_ANOMALY_SCHEMA)


def open_run(run_dir: str | os.PathLike[str],
             connection: duckdb.DuckDBPyConnection | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with a view per table of the run's store and ``anomalies``.

    Args:
        run_dir: ``{output_dir}/{run_name}``.
        connection: where to create the views (default: a new in-memory database).

    Returns:
        The connection; ``con.sql("SELECT ...")`` is a relation (``.df()``, ``.arrow()``, ``.fetchall()``).

    Raises:
        StoreError: no such run, no store in it, or a view cannot be created (a corrupt file).
    """
    path = Path(run_dir)
    if not is_dir(path):
        what = "is not a directory" if os.path.lexists(path) else "does not exist"
        raise StoreError(f"run directory {run_dir} {what}")
    tables = table_files(path)
    con = connection if connection is not None else duckdb.connect()
    for table, files in tables.items():
        file_list = "[" + ", ".join(_literal(str(file)) for file in files) + "]"
        try:
            con.execute(f"CREATE OR REPLACE VIEW {_identifier(table)} AS SELECT * FROM read_parquet({file_list}, "
                        "hive_partitioning = true, union_by_name = true)")
        except duckdb.Error as exc:
            raise StoreError(f"{path / STORE_DIR / table}: {str(exc).splitlines()[0]}") from None
    try:
        events = read_anomalies(path)
    except OSError as exc:
        raise StoreError(f"{path}: cannot read anomalies.jsonl ({exc})") from None
    con.register(f"{ANOMALIES}_events", events)
    con.execute(f"CREATE OR REPLACE VIEW {ANOMALIES} AS SELECT * FROM {ANOMALIES}_events")
    return con


def views(connection: duckdb.DuckDBPyConnection) -> list[str]:
    """The names of the views :func:`open_run` made."""
    rows = connection.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal ORDER BY view_name").fetchall()
    return [str(name) for (name,) in rows if not str(name).endswith("_events")]


def describe(connection: duckdb.DuckDBPyConnection) -> str:
    """One line per view: its name and columns (``trainmon query RUN --tables``)."""
    lines = []
    for view in views(connection):
        columns = connection.execute(f"DESCRIBE {_identifier(view)}").fetchall()
        lines.append(f"{view}: " + ", ".join(f"{name} {kind}" for name, kind, *_ in columns))
    return "\n".join(lines)


__all__ = ["ANOMALIES", "StoreError", "describe", "open_run", "read_anomalies", "table_files", "views"]
