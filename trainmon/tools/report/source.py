"""A run as one DuckDB connection for ``trainmon report`` and ``trainmon serve`` (framework-free).

A family in the run's store is its view of :func:`trainmon.tools.store.open_run` (nothing is read until a query
asks); a run written with both sinks is read from its store. A family with CSV files only (an older run,
``sinks: [csv]``, msprobe's output) is read with the CSV readers (:func:`trainmon.tools.store_reader.read_source`,
as ``csv2tb`` reads it) and registered under the same name with the same columns (``rank, step, micro_step,
vpp_stage, order, name`` and one DOUBLE per metric; ``order`` is a row's first appearance in its file), as is
``scalars`` (``rank, step, name, value``). Every query of the report then runs on either alike.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np
import numpy.typing as npt
import pyarrow as pa

from trainmon.sinks.store_layout import KEY_COLUMNS, NOT_FAMILIES, SCALARS, Part, parse_part
from trainmon.tools.readers import Table
from trainmon.tools.store_reader import Source, StoreError, StoreFamily, read_source, source_family, store_families

if TYPE_CHECKING:
    from trainmon.anomaly.step_ranges import StepRanges


@dataclass
class Family:
    """What a row family holds (from the data, not from a config).

    Attributes:
        name: the family (the view's name).
        metrics: its metric columns, in table order.
        ranks: the ranks with rows.
        first_step: its first step.
        last_step: its last step.
    """

    name: str
    metrics: list[str]
    ranks: list[int]
    first_step: int
    last_step: int


@dataclass
class RunSource:
    """The connection and what it holds. Queries go through :meth:`query` (one at a time: ``serve`` answers
    requests on threads).

    Attributes:
        run_dir: the run directory.
        connection: the DuckDB connection with a view or table per family and ``scalars``.
        families: the row families, by name.
        scalar_ranks: the ranks with scalars (empty without ``scalars``).
        scalar_steps: the first and last step of the scalars (None without them).
        csv_files: CSV files read.
        store_tables: store tables queried (a family of one rank each).
        ranks: only these ranks are shown (None: every rank).
    """

    run_dir: Path
    connection: duckdb.DuckDBPyConnection
    families: dict[str, Family]
    scalar_ranks: list[int]
    csv_files: int
    store_tables: int
    ranks: StepRanges | None = None
    scalar_steps: tuple[int, int] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def all_ranks(self) -> list[int]:
        """Every rank with rows or scalars."""
        return sorted({r for family in self.families.values() for r in family.ranks} | set(self.scalar_ranks))

    def query(self, sql: str, params: Sequence[Any] = ()) -> dict[str, npt.NDArray[Any]]:
        """The result's columns as numpy arrays (strings as object arrays).

        Raises:
            StoreError: DuckDB could not read the data (a corrupt part: its path is in the message).
        """
        with self._lock:
            try:
                return dict(self.connection.execute(sql, list(params)).fetchnumpy())
            except duckdb.Error as exc:
                raise StoreError(f"{self.run_dir}: {str(exc).splitlines()[0]}") from None

    def arrow(self, sql: str, params: Sequence[Any] = ()) -> pa.Table:
        """The result as an Arrow table (strings stay Arrow strings: no Python object per row).

        Raises:
            StoreError: as :meth:`query`.
        """
        with self._lock:
            try:
                relation = self.connection.sql(sql, params=list(params) or None)
                fetch = getattr(relation, "to_arrow_table", None) or relation.arrow  # duckdb 2 / 1
                result: pa.Table = fetch()
            except duckdb.Error as exc:
                raise StoreError(f"{self.run_dir}: {str(exc).splitlines()[0]}") from None
        return result

    def close(self) -> None:
        """Stop a query in progress (``serve`` stopped by Ctrl-C) and close the connection."""
        with contextlib.suppress(duckdb.Error):  # closed already
            self.connection.interrupt()
        with self._lock:
            self.connection.close()


def identifier(name: str) -> str:
    """A SQL identifier, quoted."""
    return '"' + name.replace('"', '""') + '"'


def open_source(run_dir: Path, by_rank: dict[int, list[Source]], *, ranks: StepRanges | None = None,
                families: Sequence[str] | None = None, on_file: Callable[[], None] | None = None) -> RunSource:
    """The run's families as views (store) or registered tables (CSV files).

    Args:
        run_dir: the run directory.
        by_rank: each rank's sources (:func:`trainmon.tools.report.data.sources`).
        ranks: only these ranks' CSV files are read (a store is read by rank when queried).
        families: only these families are made available (besides ``scalars``); None: all.
        on_file: called after each CSV file or store table is taken in (a progress bar).

    Raises:
        StoreError: the store cannot be opened or read.
        CsvFormatError: a malformed CSV file.
        OSError: a CSV file cannot be read.
    """
    from trainmon.tools.store import open_run  # duckdb views of the store

    in_store = store_families(run_dir)
    stored = {item.family for families_of_rank in in_store.values() for item in families_of_rank}
    store_tables = sum(_wanted(item.family, families) and (ranks is None or rank in ranks)
                       for rank, families_of_rank in in_store.items() for item in families_of_rank)
    connection = duckdb.connect()
    try:
        connection.execute("SET preserve_insertion_order = false")
        with contextlib.suppress(duckdb.Error):  # a setting of newer versions: parts' footers read once
            connection.execute("SET parquet_metadata_cache = true")
        if stored:
            open_run(run_dir, connection)
        csv_tables: dict[str, list[pa.Table]] = {}
        csv_files = 0
        for _ in range(store_tables):
            if on_file is not None:
                on_file()
        for rank, sources in sorted(by_rank.items()):
            if ranks is not None and rank not in ranks:
                continue
            for item in sources:
                family = source_family(item)
                if isinstance(item, StoreFamily) or family in stored or not _wanted(family, families):
                    continue
                tables, _ = read_source(item)
                csv_tables.setdefault(family, []).extend(_arrow(table, rank) for table in tables)
                csv_files += 1
                if on_file is not None:
                    on_file()
        for family, tables in csv_tables.items():
            merged = pa.concat_tables(tables, promote_options="default")
            connection.register(family, merged)
        source = RunSource(run_dir, connection, {}, [], csv_files, store_tables, ranks)
        for family in sorted(set(csv_tables) - {SCALARS}):
            described = _describe(source, family)
            if described is not None:
                source.families[family] = described
        in_store_described = _describe_store(run_dir, ranks) if stored else {}
        for family, described in in_store_described.items():
            if family != SCALARS and _wanted(family, families):
                source.families[family] = described
        source.families = dict(sorted(source.families.items()))
        if SCALARS in in_store_described:
            scalars = in_store_described[SCALARS]
            source.scalar_ranks, source.scalar_steps = scalars.ranks, (scalars.first_step, scalars.last_step)
        elif SCALARS in csv_tables:
            rows = source.query(f"SELECT rank, min(step) AS first, max(step) AS last FROM {SCALARS}"
                                f"{source_filter(source)} GROUP BY rank ORDER BY rank")
            source.scalar_ranks = [int(r) for r in rows["rank"]]
            if source.scalar_ranks:
                source.scalar_steps = (int(rows["first"].min()), int(rows["last"].max()))
    except BaseException:
        connection.close()
        raise
    return source


def source_filter(source: RunSource, prefix: str = " WHERE ") -> str:
    """``WHERE rank IN (...)`` for a source limited to some ranks; ``""`` otherwise."""
    if source.ranks is None:
        return ""
    clauses = [f"rank = {low}" if low == high else f"rank BETWEEN {low} AND {high}"
               for low, high in source.ranks.ranges]
    return prefix + "(" + " OR ".join(clauses or ["FALSE"]) + ")"


def _wanted(family: str, families: Sequence[str] | None) -> bool:
    return family == SCALARS or families is None or family in families


def _describe(source: RunSource, family: str) -> Family | None:
    """A family taken in from CSV files: its metrics, ranks and steps; None when it has no rows."""
    columns = source.query(f"DESCRIBE {identifier(family)}")
    metrics = [str(name) for name, kind in zip(columns["column_name"], columns["column_type"])
               if name not in KEY_COLUMNS and name != "rank" and str(kind) in ("DOUBLE", "FLOAT")]
    per_rank = source.query(f"SELECT rank, min(step) AS first, max(step) AS last "
                            f"FROM {identifier(family)}{source_filter(source)} GROUP BY rank ORDER BY rank")
    if not len(per_rank["rank"]):
        return None
    return Family(family, metrics, [int(r) for r in per_rank["rank"]], int(per_rank["first"].min()),
                  int(per_rank["last"].max()))


def _describe_store(run_dir: Path, ranks: StepRanges | None) -> dict[str, Family]:
    """The store's families from the names of their parts (ranks, first and last steps: no file is opened) and
    the schemas of the lowest rank's parts (metrics). A query per family on a view of thousands of parts would
    cost a second each: DuckDB binds the view, reading every part's schema, on every query.

    Raises:
        StoreError: the store cannot be listed or a schema read.
    """
    import pyarrow.parquet as pq

    from trainmon.tools.store import table_files

    out: dict[str, Family] = {}
    for family, paths in table_files(run_dir).items():
        if family in NOT_FAMILIES:  # the grad probe's tables have their own section of the page
            continue
        by_rank: dict[int, list[Part]] = {}
        for path in paths:
            part = parse_part(path)
            rank_text = path.parent.name[5:]
            if part is not None and rank_text.isdigit() and (ranks is None or int(rank_text) in ranks):
                by_rank.setdefault(int(rank_text), []).append(part)
        if not by_rank:
            continue
        metrics: list[str] = []
        for part in by_rank[min(by_rank)]:
            try:
                schema = pq.read_schema(part.path)
            except (OSError, pa.ArrowException) as exc:
                raise StoreError(f"{part.path}: not a readable store part ({str(exc).splitlines()[0]})") from None
            metrics += [f.name for f in schema if f.name not in KEY_COLUMNS and f.name != "rank"
                        and pa.types.is_floating(f.type) and f.name not in metrics]
        parts = [part for own in by_rank.values() for part in own]
        out[family] = Family(family, metrics, sorted(by_rank), min(p.first_step for p in parts),
                             max(p.last_step for p in parts))
    return out


def _arrow(table: Table, rank: int) -> pa.Table:
    """A CSV file's :class:`~trainmon.tools.readers.Table` in the columns of a store view."""
    count = len(table.rows)
    names = sorted({name for _, name in table.keys})
    name_index = {name: i for i, name in enumerate(names)}
    key_name = np.array([name_index[name] for _, name in table.keys], dtype=np.int32)
    key_vpp = np.array([vpp for vpp, _ in table.keys], dtype=np.int32)
    rows = table.rows.astype(np.int64)
    columns: dict[str, Any] = {"rank": pa.array(np.full(count, rank, np.int64)), "step": pa.array(table.steps)}
    if table.family == SCALARS:
        columns["name"] = pa.DictionaryArray.from_arrays(pa.array(key_name[rows] if count else key_name[:0]),
                                                         pa.array(names, pa.string()))
        columns["value"] = pa.array(table.values[:, 0] if table.values.shape[1] else np.full(count, np.nan))
        return pa.table(columns)
    columns["micro_step"] = pa.array(table.micro_steps)
    columns["vpp_stage"] = pa.array(key_vpp[rows] if count else key_vpp[:0])
    columns["order"] = pa.array(table.rows.astype(np.int32))  # first appearance: execution order
    columns["name"] = pa.DictionaryArray.from_arrays(pa.array(key_name[rows] if count else key_name[:0]),
                                                     pa.array(names, pa.string()))
    for i, metric in enumerate(table.metrics):
        columns[metric] = pa.array(table.values[:, i])
    return pa.table(columns)


__all__ = ["Family", "RunSource", "identifier", "open_source", "source_filter"]
