"""``trainmon convert RUN_DIR``: an old run's CSV files, or msprobe's monitor CSV output, as a run store.

The store (:mod:`trainmon.sinks.store_layout`) is written under the folder given, ``RUN_DIR/store/``, so that
``trainmon query`` and ``trainmon analyse`` (in SQL, with its row sections) work on it; nothing else is written
or changed. Every table is written under a hidden ``RUN_DIR/.store-convert-*`` folder that is renamed to
``store`` at the end: a failed or interrupted conversion leaves no store (and no half of one).

- **A trainmon run** (``rank{R}/{family}.csv``, ``{family}_{n}.csv``, ``scalars.csv``): each file's rows become
  parts of ``store/{family}/rank={R}/`` (the same columns the Parquet sink writes), ``rank{R}/anomalies.jsonl``
  becomes ``store/anomalies/rank={R}/events-{start}-{end}.parquet`` files (its complete lines, 64 MiB of them a
  file, named by their byte range as the sink names them at close). Other CSV files of a rank folder
  (``free_benchmark.csv``) are not rows of a family and are skipped.
- **msprobe's output** (``$MONITOR_OUTPUT_DIR/{time}-rank{R}-{id}/{family}_{a}-{b}.csv``, msprobe 1.2 and 8.x-26.x
  layouts): rows get trainmon's names (as ``trainmon csv2tb`` names them), their micro-step (the
  ``micro_step`` column, or 1.2's ``{module}_{micro_step}``) and VPP stage; ``shape`` and ``dtype`` are left out.
  msprobe's ``anomaly.json`` events stay where they are (``trainmon analyse`` reads them, in msprobe's order).

Values are the CSV's, parsed as float64 (``float(text)``: the sink's own ``repr`` round-trips exactly). What a CSV
does not hold is filled in: ``phase`` is the family's (:data:`~trainmon.base.records.PHASE_OF_FAMILY`; msprobe's
other families ``optimizer``), ``order`` the row's position among its family's rows of the same step and
micro-step (the CSV keeps no execution order across families), ``pp_stage`` 0, and ``nonfinite`` is true when a
value of the row is NaN or Inf, or its ``nans`` or ``infs`` count is above 0. The rows of a file become a part's
columns in :mod:`trainmon.tools.convert_parts`; this module finds the files and writes the store.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from trainmon.base.inputs import (
    describe_os_error,
    find_runs,
    is_dir,
    open_regular,
    rank_dirs_of,
    runs_hint,
)
from trainmon.base.progress import Bar
from trainmon.base.records import FAMILIES
from trainmon.base.safe_io import make_dirs, write_atomic
from trainmon.errors import UsageError
from trainmon.sinks.store_events import EVENTS_FILE, events_table
from trainmon.sinks.store_layout import (
    ANOMALIES,
    SCALARS,
    STORE_DIR,
    parquet_bytes,
    part_name,
    schema_mark_bytes,
    schema_mark_name,
    schema_token,
)
from trainmon.tools.convert_parts import OrderCounter, msprobe_part, rows_part, scalars_part
from trainmon.tools.msprobe_output import RANK_FOLDER, csv_family, rank_folders
from trainmon.tools.readers import CsvFormatError, family_of, read_table_blocks

if TYPE_CHECKING:
    from trainmon.tools.command import Subparsers

PART_ROWS = 1 << 22
"""Rows of a CSV file read and written as one part at most (bounds the memory of a conversion)."""
EVENT_BYTES = 1 << 26
"""Bytes of an ``anomalies.jsonl`` stored as one events file at most (then up to the end of the line)."""
MARKER = "_convert.json"
"""Written into the store it made: what was converted, from where, when (DuckDB, Dask and Spark skip ``_`` names)."""
_TABLE_NAME = re.compile(r"[A-Za-z0-9_]{1,100}")
_RANK_DIR = re.compile(r"rank(\d+)")


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Register ``convert`` on the ``trainmon`` command's subparsers."""
    parser = subparsers.add_parser(
        "convert", help="write the run store of an old CSV run or of msprobe's output (for query and analyse)",
        description="Convert a trainmon run's CSV files (rank{R}/{family}.csv, scalars.csv, anomalies.jsonl) or "
                    "msprobe's monitor CSV output ({time}-rank{R}-{id}/{family}_{a}-{b}.csv) into the run store, "
                    "RUN_DIR/store/ (Parquet, as sinks: [parquet] writes it), so that trainmon query and trainmon "
                    "analyse work on it. Nothing is overwritten: an existing store is refused (exit 2).")
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="run directory ({output_dir}/{run_name}) or msprobe's output folder ($MONITOR_OUTPUT_DIR)")
    parser.set_defaults(func=run_cli)
    return parser


@dataclass
class _Source:
    """One CSV file to convert: its rank, table and layout."""

    path: Path
    rank: int
    table: str
    msprobe: bool


@dataclass
class _Writer:
    """Parts written under the hidden folder, named as the sink names them (one writer token, a sequence)."""

    run_dir: Path
    staging: Path
    token: str = field(default_factory=lambda: os.urandom(4).hex())
    seq: int = 0
    rows: int = 0
    tables: set[str] = field(default_factory=set)
    marks: set[Path] = field(default_factory=set)

    def write(self, path: Path, data: bytes) -> None:
        """Write one file of the store being made.

        Raises:
            UsageError: it cannot be written (``cannot write`` and the reason).
        """
        try:
            make_dirs(path.parent, self.run_dir)
            write_atomic(path, data, root=self.run_dir, exclusive=True)
        except OSError as exc:
            raise UsageError(f"cannot write {describe_os_error(exc, path)}") from None

    def part(self, table: str, rank: int, data: pa.Table) -> None:
        steps = data.column("step").to_numpy()
        name = part_name(int(steps.min()), int(steps.max()), self.token, self.seq, self.seq)
        folder = self.staging / table / f"rank={rank}"
        mark = folder / schema_mark_name(self.token, schema_token(data.schema))
        if mark not in self.marks:  # as the sink marks its schemas: the views need no union_by_name
            self.write(mark, schema_mark_bytes(data.schema))
            self.marks.add(mark)
        self.write(folder / name, parquet_bytes(data))
        self.seq += 1
        self.rows += data.num_rows
        self.tables.add(table)

    def events(self, rank: int, jsonl: Path) -> int:
        """The complete lines of a rank's ``anomalies.jsonl`` as its stored events, :data:`EVENT_BYTES` of the file
        at a time (one ``events-{start}-{end}.parquet`` each, named by its byte range as the sink names them);
        returns the events stored. A last line without its newline (cut by a crash) is left to the file."""
        stored, start, rest = 0, 0, b""
        with open_regular(jsonl) as handle:
            while True:
                block = handle.read(EVENT_BYTES)
                text = rest + block
                end = text.rfind(b"\n") + 1
                if end:
                    events = events_table(text[:end])
                    name = f"events-{start:015d}-{start + end:015d}.parquet"
                    self.write(self.staging / ANOMALIES / f"rank={rank}" / name, parquet_bytes(events))
                    self.tables.add(ANOMALIES)
                    stored += events.num_rows
                    start, text = start + end, text[end:]
                rest = text
                if not block:
                    return stored


def run_cli(args: argparse.Namespace) -> int:
    """The ``convert`` command; returns the exit code.

    Raises:
        UsageError: RUN_DIR is missing, is a rank folder or a folder of runs, holds no CSV files of trainmon or
            msprobe, already has a store, or a CSV file is malformed (file and line named); nothing is left behind.
    """
    started = time.perf_counter()
    run_dir = Path(args.run_dir)
    if not is_dir(run_dir):
        what = "is not a directory" if os.path.lexists(run_dir) else "does not exist"
        raise UsageError(f"run directory {run_dir} {what}")
    store = run_dir / STORE_DIR
    if os.path.lexists(store):
        raise UsageError(f"{store} already exists: nothing converted (a store is never overwritten; "
                         f"trainmon query and analyse read it as it is)")
    if _RANK_DIR.fullmatch(run_dir.name) and not rank_dirs_of(run_dir):
        raise UsageError(f"{run_dir} is one rank folder: pass the run directory, trainmon convert {run_dir.parent}")
    sources, events, skipped, layout = _sources(run_dir)
    if not sources and not events:
        runs = find_runs(run_dir)
        if runs:
            raise UsageError(runs_hint(run_dir, runs, "convert"))
        raise UsageError(f"{run_dir} holds no CSV files of trainmon (rank{{R}}/{{family}}.csv) or msprobe "
                         "({time}-rank{R}-{id}/{family}_{a}-{b}.csv) to convert")
    staging = run_dir / f".{STORE_DIR}-convert-{os.urandom(4).hex()}"
    writer = _Writer(run_dir, staging)
    stored = 0
    try:
        with Bar(len(sources) + len(events), "convert") as bar:
            for source in sources:
                _convert(source, writer)
                bar.advance(rows=writer.rows)
            for rank, jsonl in events:
                stored += writer.events(rank, jsonl)
                bar.advance(rows=writer.rows)
        marker = {"converted_by": "trainmon convert", "layout": layout, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                  time.gmtime()), "files": [str(s.path.relative_to(run_dir)) for s in sources]
                  + [str(path.relative_to(run_dir)) for _, path in events], "rows": writer.rows, "events": stored}
        writer.write(staging / MARKER, (json.dumps(marker, indent=1) + "\n").encode())
        if os.path.lexists(store):
            raise UsageError(f"{store} appeared while converting: left as it is, nothing converted")
        try:
            os.rename(staging, store)
        except OSError as exc:
            raise UsageError(f"cannot write {describe_os_error(exc, store)}") from None
    except CsvFormatError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:  # the writes raise UsageError: this is a file that cannot be read
        raise UsageError(f"cannot read {describe_os_error(exc)}") from None
    finally:
        if os.path.lexists(staging):
            shutil.rmtree(staging, ignore_errors=True)
    for path in skipped[:10]:
        print(f"skipped {path.relative_to(run_dir)}: not a file of a row family or the scalars")
    ranks = len({s.rank for s in sources} | {rank for rank, _ in events})
    print(f"converted {len(sources)} {layout} file{'s' if len(sources) != 1 else ''} of {ranks} "
          f"rank{'s' if ranks != 1 else ''} ({writer.rows} rows, {stored} anomaly events, {writer.seq} parts in "
          f"{len(writer.tables)} tables) into {store} in {time.perf_counter() - started:.1f} s")
    return 0


def _sources(run_dir: Path) -> tuple[list[_Source], list[tuple[int, Path]], list[Path], str]:
    """The CSV files to convert, the ``anomalies.jsonl`` files to store, the CSV files skipped, and the layout."""
    sources: list[_Source] = []
    events: list[tuple[int, Path]] = []
    skipped: list[Path] = []
    for rank_dir in rank_dirs_of(run_dir):
        rank = int(rank_dir.name[4:])
        for path in _csv_files(rank_dir):
            family = family_of(path)
            if family in FAMILIES or family == SCALARS:
                sources.append(_Source(path, rank, family, msprobe=False))
            else:
                skipped.append(path)
        if os.path.lexists(rank_dir / EVENTS_FILE):
            events.append((rank, rank_dir / EVENTS_FILE))
    if sources or events:
        return sources, events, skipped, "trainmon CSV"
    for folder in rank_folders(run_dir):
        match = RANK_FOLDER.fullmatch(folder.name)
        if match is None:
            continue
        for path in _csv_files(folder):
            table = csv_family(path)
            if table is not None and _TABLE_NAME.fullmatch(table):
                sources.append(_Source(path, int(match.group(2)), table, msprobe=True))
            else:
                skipped.append(path)
    return sources, [], skipped, "msprobe CSV"


def _csv_files(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.suffix == ".csv")  # not a regular file: an error on reading
    except OSError:
        return []


def _convert(source: _Source, writer: _Writer) -> None:
    if source.msprobe:
        writer.part(source.table, source.rank, msprobe_part(source.path, source.table))
        return
    counter = OrderCounter()
    for block in read_table_blocks(source.path, PART_ROWS):
        if len(block.steps):
            part = scalars_part(block) if source.table == SCALARS else rows_part(block, counter)
            writer.part(source.table, source.rank, part)


__all__ = ["EVENT_BYTES", "MARKER", "PART_ROWS", "add_parser", "run_cli"]
