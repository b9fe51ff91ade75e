"""``trainmon query RUN_DIR "SELECT ..."``: one SQL query over a run's store (DuckDB, embedded).

The tables are the views of :func:`trainmon.tools.store.open_run` (one per family, ``scalars``,
``anomalies``, each with a ``rank`` column). Only one ``SELECT`` (or ``EXPLAIN``) statement is run: a query
reads, it never writes a file. The result is printed as an aligned table (``--max-rows`` rows at most),
or in full as CSV or JSON lines.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

from trainmon.base.inputs import find_runs
from trainmon.errors import UsageError
from trainmon.tools.store import describe, open_run
from trainmon.tools.store_reader import StoreError

if TYPE_CHECKING:
    from trainmon.tools.command import Subparsers

_READING = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Register ``query`` on the ``trainmon`` command's subparsers."""
    parser = subparsers.add_parser(
        "query", help="run one SQL query over a run's store (DuckDB)",
        description="Run one SELECT over a run's Parquet store with DuckDB. Tables: one per family (actv, "
                    "grad_reduced, exp_avg, ...), scalars and anomalies, each with a rank column. "
                    "--tables lists them with their columns.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory ({output_dir}/{run_name}) with a store/")
    parser.add_argument("sql", metavar="SQL", nargs="?", default=None, help="one SELECT statement")
    parser.add_argument("--tables", action="store_true", help="list the tables and their columns")
    parser.add_argument("--format", choices=("table", "csv", "jsonl"), default="table",
                        help="table (default, at most --max-rows rows), csv or jsonl (every row)")
    parser.add_argument("--max-rows", type=int, default=100, metavar="N", help="rows of the table format (100)")
    parser.set_defaults(func=run_cli)
    return parser


def _check_sql(sql: str) -> None:
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise UsageError(f"SQL: {str(exc).splitlines()[0]}") from None
    if len(statements) != 1:
        raise UsageError(f"SQL: expected one statement, got {len(statements)}")
    if statements[0].type not in _READING:
        raise UsageError(f"SQL: only a SELECT is run (a query never writes), got {statements[0].type.name}")


def _cell(value: Any, whole: bool = True) -> str:
    """A value as text; binary values (grad_directions' bits) in hex, or only their size when not ``whole``."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex() if whole else f"<{len(value)} bytes>"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else "inf" if value > 0 else "-inf")
    return "" if value is None else str(value)


def _not_json(value: Any) -> bool:
    """NaN, Inf and binary values are written as :func:`_cell`'s text in JSON."""
    return isinstance(value, bytes) or (isinstance(value, float) and not math.isfinite(value))


def _print(columns: list[str], rows: list[tuple[Any, ...]], fmt: str, more: bool) -> None:
    if fmt == "csv":
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([[_cell(v) for v in row] for row in rows])
        return
    if fmt == "jsonl":
        for row in rows:
            print(json.dumps({c: (_cell(v) if _not_json(v) else v) for c, v in zip(columns, row)}, default=str))
        return
    cells: list[list[str]] = [columns] + [[_cell(v, whole=False) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for line in cells:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    print(f"({len(rows)} rows{', more not shown: --max-rows or --format csv' if more else ''})")


def run_cli(args: argparse.Namespace) -> int:
    """The ``query`` command; returns the exit code.

    Raises:
        UsageError: no such run or no store in it, a folder of runs, no SQL, a statement that is not one
            SELECT, or an error of the query (an unknown table or column, a syntax error), in one line.
    """
    if args.max_rows < 1:
        raise UsageError(f"--max-rows must be >= 1, got {args.max_rows}")
    if args.sql is None and not args.tables:
        raise UsageError("give a SQL query (or --tables)")
    if args.sql is not None:
        _check_sql(args.sql)
    try:
        con = open_run(args.run_dir)
    except StoreError as exc:
        runs = [run for run in find_runs(Path(args.run_dir)) if (run / "store").is_dir()]
        if runs:
            raise UsageError(f"{args.run_dir} is a folder of runs: pass one, e.g. trainmon query {runs[-1]} ...") \
                from None
        raise UsageError(str(exc)) from None
    with con:
        if args.tables:
            print(describe(con))
        if args.sql is None:
            return 0
        try:
            result = con.execute(args.sql)
            columns = [d[0] for d in result.description or []]
            if args.format == "table":
                rows = result.fetchmany(args.max_rows + 1)
                more, rows = len(rows) > args.max_rows, rows[:args.max_rows]
            else:
                rows, more = result.fetchall(), False
        except duckdb.Error as exc:
            raise UsageError(f"SQL: {str(exc).splitlines()[0]}") from None
    _print(columns, rows, args.format, more)
    return 0
