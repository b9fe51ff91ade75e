"""Reading a run's store with DuckDB: :func:`open_run` gives a connection with one view per table.

Views (each with a ``rank`` column, from the ``rank={R}`` partition of its files):

- one per family written (``actv``, ``actv_grad``, ``grad_unreduced``, ``grad_reduced``, ``exp_avg``, ...):
  ``step, micro_step, vpp_stage, pp_stage, order, phase, name, nonfinite`` and one DOUBLE column per metric;
- ``scalars``: ``step, name, value``;
- ``anomalies``: every rank's anomaly events (the fields of an ``AnomalyEvent``; NaN and Inf as DOUBLE values):
  those stored at close and the lines of ``anomalies.jsonl`` written after them; empty when there is none. The
  stored files are read by DuckDB as a query needs them (never loaded whole); ``seq`` orders the events of a rank
  as they were written (the byte offset of their stored file, or of the unstored lines, plus their row number).
- ``replicas`` (only in a run that wrote rows once per data-parallel group, see
  :mod:`trainmon.sinks.store_replicas`): ``family, rank, writer, first_step, last_step``. A family view gives
  every rank of such a group its writer's rows (``rank`` is the rank they stand for), so ``WHERE rank = 1``
  reads rank 1's rows whoever wrote them.

Example:
    >>> con = open_run("trainmon_output/run")  # doctest: +SKIP
    >>> con.sql("SELECT rank, step, name FROM grad_reduced WHERE nonfinite LIMIT 5").df()  # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from trainmon.base.inputs import is_dir, rank_dirs_of
from trainmon.sinks.store_events import EVENT_SCHEMA, events_of_rank, stored_ranges, unstored_events
from trainmon.sinks.store_layout import ANOMALIES, STORE_DIR, live_parts, schema_of_marks, table_dir
from trainmon.sinks.store_replicas import ReplicaLayoutError, replica_layouts, replica_map
from trainmon.tools.store_reader import StoreError  # its home: report and csv2tb catch it without importing duckdb

REPLICAS = "replicas"
"""The table of where each rank's rows of a family written once per data-parallel group are."""
_REPLICA_SCHEMA = pa.schema([("family", pa.string()), ("rank", pa.int64()), ("writer", pa.int64()),
                             ("first_step", pa.int64()), ("last_step", pa.int64())])


def table_files(run_dir: str | os.PathLike[str]) -> dict[str, list[Path]]:
    """The live Parquet parts of each table of a run's store (every rank), by table name.

    Raises:
        StoreError: ``run_dir`` has no ``store/`` folder.
    """
    return {table: files for table, (files, _) in table_sources(run_dir).items()}


def table_sources(run_dir: str | os.PathLike[str]) -> dict[str, tuple[list[Path], bool]]:
    """The live Parquet parts of each table of a run's store (every rank), by table name, and whether they all
    have one schema: every writer of every rank marked one schema in its folder, the same
    (:func:`~trainmon.sinks.store_layout.schema_of_marks`; learnt from the listings, no file read).

    Raises:
        StoreError: ``run_dir`` has no ``store/`` folder.
    """
    store = Path(run_dir) / STORE_DIR
    if not is_dir(store):
        raise StoreError(f"{run_dir} has no {STORE_DIR}/ folder (a run written with sinks: [parquet] has one)")
    tables: dict[str, tuple[list[Path], bool]] = {}
    try:
        for table in sorted(store.iterdir()):
            if not is_dir(table) or table.name.startswith((".", "_")) or table.name == ANOMALIES:
                continue
            files: list[Path] = []
            tokens: set[str | None] = set()
            for rank_dir in sorted(table.glob("rank=*")):
                if is_dir(rank_dir):
                    entries = sorted(rank_dir.iterdir())
                    parts = live_parts(entries)
                    if parts:
                        files += [part.path for part in parts]
                        tokens.add(schema_of_marks(parts, [entry.name for entry in entries]))
            if files:
                tables[table.name] = (files, len(tokens) == 1 and None not in tokens)
    except OSError as exc:
        raise StoreError(f"{store}: cannot list the store ({exc.strerror or exc})") from None
    return tables


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _identifier(text: str) -> str:
    return '"' + text.replace('"', '""') + '"'


EVENT_COLUMNS: tuple[str, ...] = ("step", "micro_step", "rank", "phase", "pp_stage", "vpp_stage", "order", "detector",
                                  "family", "name", "metric", "value", "baseline", "message", "time")
"""The columns of the ``anomalies`` view before ``seq`` (those of :func:`read_anomalies`)."""
UNSTORED_EVENTS = "_anomalies_unstored"
"""The temporary table of the events not in the store's files (read from ``anomalies.jsonl``)."""


def event_ranks(run_dir: Path) -> list[int]:
    """The ranks with a ``rank{R}/`` folder or stored anomaly events."""
    ranks = {int(p.name[4:]) for p in rank_dirs_of(run_dir)}
    stored = run_dir / STORE_DIR / ANOMALIES
    if is_dir(stored):
        ranks |= {int(p.name[5:]) for p in stored.glob("rank=*") if p.name[5:].isdigit() and is_dir(p)}
    return sorted(ranks)


def anomaly_sources(run_dir: str | os.PathLike[str]) -> tuple[list[Path], pa.Table]:
    """The stored event files of every rank (by rank, then byte range) and the events after them, read from each
    rank's ``anomalies.jsonl``, as one Arrow table with ``rank`` and ``seq`` columns (the view's columns)."""
    path = Path(run_dir)
    files: list[Path] = []
    tails = []
    for rank in event_ranks(path):
        files += [file for _, _, file in stored_ranges(table_dir(path, ANOMALIES, rank))]
        start, events = unstored_events(path, rank)
        events = events.add_column(2, "rank", pa.array(np.full(events.num_rows, rank, np.int64)))
        tails.append(events.append_column("seq", pa.array(start + np.arange(events.num_rows, dtype=np.int64))))
    schema = EVENT_SCHEMA.insert(2, pa.field("rank", pa.int64())).append(pa.field("seq", pa.int64()))
    return files, pa.concat_tables(tails) if tails else schema.empty_table()


def read_anomalies(run_dir: str | os.PathLike[str]) -> pa.Table:
    """Every rank's anomaly events as one Arrow table with a ``rank`` column: what the store holds and the
    lines of ``anomalies.jsonl`` written after it (a run still open or killed); see
    :mod:`trainmon.sinks.store_events`. Loads every event: ``open_run``'s ``anomalies`` view reads them lazily."""
    path = Path(run_dir)
    tables = []
    for rank in event_ranks(path):
        events = events_of_rank(path, rank)
        tables.append(events.add_column(2, "rank", pa.array([rank] * events.num_rows, pa.int64())))
    if not tables:
        return EVENT_SCHEMA.insert(2, pa.field("rank", pa.int64())).empty_table()
    return pa.concat_tables(tables)


def read_replicas(run_dir: str | os.PathLike[str]) -> pa.Table:
    """The ``replicas`` table of a run: ``family, rank, writer, first_step, last_step`` (from its ``run*.json``).

    Raises:
        StoreError: a ``run*.json`` that cannot be read.
    """
    try:
        rows = replica_map(replica_layouts(run_dir))
    except ReplicaLayoutError as exc:
        raise StoreError(str(exc)) from None
    return pa.Table.from_pylist([dict(zip(_REPLICA_SCHEMA.names, row)) for row in rows], schema=_REPLICA_SCHEMA)


def _family_view(table: str, source: str, replicated: bool) -> str:
    """The ``SELECT`` of a family's view: its stored rows, or, for a family written once per group, the rows of
    the ranks that wrote their own and, for every rank of a group, its writer's rows under its own rank."""
    if not replicated:
        return f"SELECT * FROM {source}"
    family = _literal(table)
    within = "s.step BETWEEN r.first_step AND r.last_step"
    return (f"WITH stored AS (SELECT * FROM {source}), map AS (SELECT * FROM {REPLICAS} WHERE family = {family}) "
            f"SELECT s.* FROM stored s ANTI JOIN map r ON s.rank = r.rank AND {within} "
            f"UNION ALL SELECT s.* REPLACE (r.rank AS rank) FROM stored s JOIN map r ON s.rank = r.writer AND {within}")


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
    tables = table_sources(path)
    replicas = read_replicas(path)
    try:
        event_files, unstored = anomaly_sources(path)
    except (OSError, pa.ArrowException) as exc:
        raise StoreError(f"{path}: cannot read the anomaly events ({exc})") from None
    replicated = set(replicas.column("family").to_pylist())
    # No progress bar: DuckDB draws it on stdout, inside the output of `trainmon query --format csv`.
    con = connection if connection is not None else duckdb.connect()
    try:
        if connection is None:
            con.execute("SET enable_progress_bar = false")
        if replicas.num_rows:
            con.register(REPLICAS, replicas)
        for table, (files, one_schema) in tables.items():
            # union_by_name reads every file's schema when the view is bound (twice the time of a query over
            # 10^5 files): only where the parts' schemas may differ (a resumed run with other metrics, old runs)
            union = "false" if one_schema else "true"
            source = f"read_parquet({_list(files)}, hive_partitioning = true, union_by_name = {union})"
            con.execute(f"CREATE OR REPLACE VIEW {_identifier(table)} AS "
                        f"{_family_view(table, source, table in replicated)}")
        _create_anomalies(con, event_files, unstored)
    except duckdb.Error as exc:
        if connection is None:
            con.close()
        raise StoreError(f"{path / STORE_DIR}: {str(exc).splitlines()[0]}") from None
    return con


def _list(files: list[Path]) -> str:
    return "[" + ", ".join(_literal(str(file)) for file in files) + "]"


def _create_anomalies(con: duckdb.DuckDBPyConnection, files: list[Path], unstored: pa.Table) -> None:
    """The ``anomalies`` view: the stored event files (read lazily) and the unstored events (a temporary table)."""
    columns = ", ".join(_identifier(name) for name in (*EVENT_COLUMNS, "seq"))
    con.register("_trainmon_unstored", unstored)
    try:
        con.execute(f"CREATE OR REPLACE TEMP TABLE {UNSTORED_EVENTS} AS SELECT {columns} FROM _trainmon_unstored")
    finally:
        con.unregister("_trainmon_unstored")
    parts = [f"SELECT {columns} FROM {UNSTORED_EVENTS}"]
    if files:
        stored = ", ".join("CAST(rank AS BIGINT) AS rank" if name == "rank" else _identifier(name)
                           for name in EVENT_COLUMNS)
        # seq: the byte offset the file starts at (its name) plus the row's number in it, so the events of a
        # rank sort as they were written, the unstored ones (from the byte after the last stored file) last
        parts.insert(0, f"SELECT {stored}, CAST(regexp_extract(filename, 'events-([0-9]+)-[0-9]+[.]parquet$', 1) "
                        f"AS BIGINT) + file_row_number AS seq FROM read_parquet({_list(files)}, hive_partitioning = "
                        "true, union_by_name = true, filename = true, file_row_number = true)")
    con.execute(f"CREATE OR REPLACE TEMP VIEW {ANOMALIES} AS " + " UNION ALL ".join(parts))


def views(connection: duckdb.DuckDBPyConnection) -> list[str]:
    """The names of the views :func:`open_run` made."""
    rows = connection.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal ORDER BY view_name").fetchall()
    return [str(name) for (name,) in rows]


def describe(connection: duckdb.DuckDBPyConnection) -> str:
    """One line per view: its name and columns (``trainmon query RUN --tables``)."""
    lines = []
    for view in views(connection):
        columns = connection.execute(f"DESCRIBE {_identifier(view)}").fetchall()
        lines.append(f"{view}: " + ", ".join(f"{name} {kind}" for name, kind, *_ in columns))
    return "\n".join(lines)


__all__ = ["EVENT_COLUMNS", "REPLICAS", "UNSTORED_EVENTS", "anomaly_sources", "describe", "event_ranks", "open_run",
           "read_anomalies", "read_replicas", "table_files", "table_sources", "views"]
