"""``trainmon csv2tb``: convert a run's CSV files to TensorBoard event files (framework-free).

A run written with ``sinks: [parquet]`` is read from its store where a family has no CSV file
(:mod:`trainmon.tools.store_reader`): the event files are the same as from that run's CSV files.

Also reads msprobe's CSV output (``$MONITOR_OUTPUT_DIR/{time}-rank{R}-{id}/{family}_{a}-{b}.csv``, msprobe
1.2 and 8.x-26.x layouts, see :mod:`trainmon.tools.msprobe_output`) and says which layout it read. This module
finds the rank folders and writes the event files; reading and checking the CSV files is
:mod:`trainmon.tools.readers`'s (its names are re-exported here).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from trainmon.base.inputs import describe_os_error, find_runs, is_dir, open_regular, rank_dirs_of, runs_hint
from trainmon.base.progress import Bar
from trainmon.base.records import FAMILIES
from trainmon.errors import UsageError
from trainmon.sinks import tensorboard as board
from trainmon.tools.msprobe_output import ANOMALY_FOLDER, rank_folders
from trainmon.tools.readers import CsvFormatError
from trainmon.tools.store_reader import (
    STORE_LAYOUT,
    Source,
    StoreError,
    replica_note,
    replica_writers,
    source_family,
    source_scalars,
    store_families,
    with_store,
)

if TYPE_CHECKING:
    from trainmon.tools.command import Subparsers

_MSPROBE_FAMILIES = ("other", "param_origin", "param_updated")


def add_parser(sub: Subparsers) -> None:
    parser = sub.add_parser("csv2tb", help="convert CSV output to TensorBoard event files",
                            description="Convert every rank's CSV files of a run to TensorBoard event files "
                                        "at full resolution (tags 0_overview/{loss,grad_norm,lr,...}, "
                                        "{family}/{name}/{metric}[/vpp{v}][/micro{m}], anomalies as text). "
                                        "A run written with sinks: [parquet] is read from its store/ where it "
                                        "has no CSV files (the same event files). Also reads msprobe's "
                                        "CSV output (MONITOR_OUTPUT_DIR or one of its {time}-rank{R}-{id} folders).")
    parser.add_argument("run_dir", help="a run directory (with rank*/ folders), one rank directory, "
                                        "or msprobe's output folder")
    parser.add_argument("-o", "--output", help="output directory (default: RUN_DIR/tensorboard)")
    parser.add_argument("--families", nargs="+", choices=[*FAMILIES, "scalars", *_MSPROBE_FAMILIES],
                        help="only these families")
    parser.add_argument("--workers", type=int, default=2, help="ranks converted in parallel (default 2)")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    run_dir = Path(args.run_dir)
    output = Path(args.output) if args.output else None
    jobs = [(run_dir, output)]
    if is_dir(run_dir) and not rank_dirs_of(run_dir) and not _has_csv(run_dir):
        # A parent output folder: convert each of its runs (to RUN/tensorboard, or OUT/RUN with -o),
        # and msprobe's rank folders beside them (to FOLDER/tensorboard/{rank folder}, or OUT/{rank folder}).
        runs = [run for run in find_runs(run_dir) if run.name != ANOMALY_FOLDER]
        if runs:
            jobs = [(run, output / run.name if output else None) for run in runs]
            if rank_folders(run_dir):
                jobs.append((run_dir, output))
    written, skipped = 0, []
    for run, out in jobs:
        try:
            count, layouts, notes = _convert(run, out, args.families, args.workers)
            written += count
        except NothingToConvert as exc:
            if len(jobs) == 1:
                raise UsageError(str(exc)) from None
            # one empty run (an attach that failed, a run that wrote nothing yet) does not stop the others
            print(f"note: skipped {exc}", file=sys.stderr)
            skipped.append(run.name)
            continue
        except OutputError as exc:
            raise UsageError(f"cannot write to {exc.filename}: {exc.strerror}") from None
        except (FileNotFoundError, CsvFormatError, StoreError) as exc:
            if isinstance(exc, FileNotFoundError) and exc.filename is not None:
                raise UsageError(describe_os_error(exc)) from None
            raise UsageError(str(exc)) from None
        except OSError as exc:  # e.g. an unwritable --output, an unreadable CSV
            raise UsageError(describe_os_error(exc, out or run / "tensorboard")) from None
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        for layout in sorted(layouts):
            print(f"{run}: read {layout}" + ("" if layout in ("trainmon CSV", STORE_LAYOUT) else
                  " (names as msprobe wrote them: squashed when its squash_name was on; see docs/msprobe.md)"))
        if len(jobs) > 1:
            print(f"{run.name}: converted to {out or run / 'tensorboard'}")
    if len(skipped) == len(jobs):
        raise UsageError(f"{run_dir}: nothing to convert: no run in it has CSV files ({', '.join(skipped[:5])}"
                         f"{', ...' if len(skipped) > 5 else ''})")
    target = output if output else (run_dir / "tensorboard" if len(jobs) == 1 else "RUN/tensorboard of each run")
    print(f"wrote {written} scalars to {target}")
    return 0


def _has_csv(folder: Path) -> bool:
    try:
        return any(folder.glob("*.csv"))
    except (OSError, ValueError):
        return False


def rank_dirs(run_dir: Path) -> list[Path]:
    """The ``rank*`` directories of a run (or the directory itself if it is one); none for a run that has only
    its ``store/`` (:func:`_sources` adds the store's ranks).

    Raises:
        FileNotFoundError: not a directory, or one with neither ``rank*/`` folders nor CSV files nor a store
            (a folder of runs is named as such, with its runs).
        StoreError: the run's store cannot be listed.
    """
    if not is_dir(run_dir):
        raise FileNotFoundError(f"{run_dir}: {'not a directory' if os.path.lexists(run_dir) else 'no such directory'}")
    ranks = rank_dirs_of(run_dir)
    if not ranks and _has_csv(run_dir):
        return [run_dir]
    if not ranks and rank_folders(run_dir):
        return rank_folders(run_dir)
    if not ranks and store_families(run_dir):  # a run's store without its rank folders: the store's ranks
        return []
    if not ranks:
        runs = find_runs(run_dir)
        if runs:
            raise FileNotFoundError(runs_hint(run_dir, runs, "csv2tb"))
        if rank_dirs_of(run_dir.parent) and store_families(run_dir.parent):
            raise FileNotFoundError(f"{run_dir}: no CSV files; its run {run_dir.parent} holds its statistics in "
                                    "store/: give the run directory")
        raise FileNotFoundError(f"{run_dir}: no rank*/ directories and no CSV files")
    return ranks


def convert(run_dir: Path, output: Path | None = None, families: list[str] | None = None, workers: int = 2) -> int:
    """Convert CSVs to ``{output}/{rank dir}/events.out.tfevents.*``; returns the number of scalars.

    ``run_dir`` may also be msprobe's output folder or one of its rank folders (msprobe's CSV layouts).

    Raises:
        FileNotFoundError: ``run_dir`` has no rank directories or CSV files.
        CsvFormatError: a malformed CSV (file and line in the message).
        StoreError: an unreadable part of the run's store (the file in the message).
        OutputError: the output cannot be written (a full disk, a read-only folder).
    """
    return _convert(run_dir, output, families, workers)[0]


def _convert(run_dir: Path, output: Path | None, families: list[str] | None,
             workers: int) -> tuple[int, set[str], list[str]]:
    """:func:`convert`, also returning the layouts read (``trainmon CSV``, ``msprobe 1.2 CSV``, ...) and a
    note per rank folder skipped because it holds nothing to convert."""
    from tensorboardX.proto.summary_pb2 import Summary
    from tensorboardX.summary import custom_scalars

    output = output or run_dir / "tensorboard"
    csv_files = _sources(run_dir)
    ranks = list(csv_files)
    if not any(csv_files.values()):
        events = any(any(rank_dir.glob("events.out.tfevents.*")) for rank_dir in ranks)
        hint = (" (msprobe wrote TensorBoard event files, format: tensorboard: open the folder in TensorBoard)"
                if events else "")
        raise NothingToConvert(f"{run_dir}: no CSV files in {', '.join(p.name for p in ranks[:5])}"
                               f"{', ...' if len(ranks) > 5 else ''}{hint}")
    # A rank folder with neither CSV files nor anomalies (an attach that failed, a rank that wrote nothing
    # yet) gets no event file: one note names them all.
    empty = [rank_dir for rank_dir in ranks
             if not csv_files[rank_dir] and not os.path.lexists(rank_dir / board.ANOMALIES_FILE)]
    ranks = [rank_dir for rank_dir in ranks if rank_dir not in empty]
    notes = [f"{run_dir}: skipped {', '.join(p.name for p in empty[:10])}{', ...' if len(empty) > 10 else ''}: "
             f"no CSV files"] if empty else []
    # families written once per data-parallel group are in their writer's event files only, for the whole group
    replicated = replica_note(replica_writers(run_dir), families, where="the event files of rank")
    notes += [f"{run_dir}: {replicated}"] if replicated else []
    layouts: set[str] = set()
    wanted_files = {rank_dir: [f for f in files if families is None or source_family(f) in families]
                    for rank_dir, files in csv_files.items()}

    def one(rank_dir: Path) -> int:
        wanted = wanted_files[rank_dir]
        # One Summary per (file, step), as the TensorBoard sink writes them: no per-value event, and
        # no warning per NaN (tensorboardX's add_scalar logs one; a monitor reports NaN quietly).
        writer = _EventOutput(output / rank_dir.name, root=output)
        writer.open()
        count = 0
        tags: set[str] = set()
        try:
            for path in wanted:
                values: list[Any] = []
                current = 0
                for tag, value, step in source_scalars(path, layouts):
                    if step != current and values:
                        writer.write_summary(current, Summary(value=values))
                        values = []
                    current = step
                    # a run-level scalar also goes to 0_overview/, as the TensorBoard sink writes it
                    for alias in board.scalar_tags(tag[8:]) if tag.startswith("scalars/") else [tag]:
                        values.append(Summary.Value(tag=alias, simple_value=value))
                        tags.add(alias)
                        count += 1
                if values:
                    writer.write_summary(current, Summary(value=values))
                bar.advance()
            if families is None:  # anomalies as the TensorBoard sink writes them: counts and text at their step
                for step, (counts, texts) in board.anomaly_summaries(_anomaly_events(rank_dir)).items():
                    writer.write_summary(step, board.anomaly_summary(counts, texts))
                    count += len(counts)
            if tags:
                writer.write_summary(0, custom_scalars(board.custom_scalar_layout(sorted(tags))))
        finally:
            writer.close()
        return count

    with Bar(sum(map(len, wanted_files.values())), "csv2tb") as bar, \
            ThreadPoolExecutor(max_workers=min(workers, len(ranks))) as pool:
        return sum(pool.map(one, ranks)), layouts, notes


def _sources(run_dir: Path) -> dict[Path, list[Source]]:
    """``rank folder -> CSV files`` of a run (:func:`rank_dirs`), with the families of its store that have no CSV
    file (a rank only in the store gets its ``rank{R}`` path, whether the folder exists or not)."""
    ranks = rank_dirs(run_dir)
    sources: dict[Path, list[Source]] = {rank_dir: [*sorted(rank_dir.glob("*.csv"))] for rank_dir in ranks}
    numbered = {int(p.name[4:]): p for p in ranks if p.parent == run_dir and p.name[4:].isdigit()}
    for rank, found in with_store(run_dir, {n: list(sources[p]) for n, p in numbered.items()}).items():
        sources[numbered.get(rank, run_dir / f"rank{rank}")] = found
    return sources


class NothingToConvert(FileNotFoundError):
    """A run whose rank folders hold no CSV file (e.g. the empty ``rank0/`` of an attach that failed)."""


class OutputError(OSError):
    """``csv2tb``'s output cannot be written (a full disk, a read-only folder); ``filename`` is the folder."""


class _EventOutput(board.EventFile):
    """An event file of the converted output, written on the converting thread: a failing write raises
    :class:`OutputError` naming the folder there and then (tensorboardX's ``FileWriter``, used before, lost
    its writer thread on a full disk and then blocked the next ``add_summary`` for ever)."""

    def open(self) -> IO[bytes]:
        with self._failing():
            return super().open()

    def write_summary(self, step: int, summary: Any) -> None:
        with self._failing():
            super().write_summary(step, summary)

    def close(self) -> None:
        with self._failing():
            super().close()

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            raise OutputError(exc.errno, exc.strerror or str(exc), str(self.rank_dir)) from None


def _anomaly_events(rank_dir: Path) -> list[dict[str, Any]]:
    """The events of ``rank_dir/anomalies.jsonl`` (none when there is no such file)."""
    try:
        with open_regular(rank_dir / board.ANOMALIES_FILE) as handle:
            return board.read_anomaly_lines(handle.read())
    except FileNotFoundError:
        return []


__all__ = ["OutputError", "add_parser", "convert"]
