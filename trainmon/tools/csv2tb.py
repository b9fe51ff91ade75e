"""``trainmon csv2tb``: export a run's statistics (its store, or its CSV files) to TensorBoard event files
(framework-free).

The tags are the TensorBoard sink's, with the same choices (:mod:`trainmon.sinks.tensorboard_overview`): by default
the bounded overview (summaries over the tensors of each step, computed from the rows read back, and the
scalars); ``--per-tensor`` adds the per-tensor tags of the tensors ``--tensors`` selects; ``--families`` and
``--metrics`` narrow both. A run written with ``sinks: [parquet]`` is read from its store where a family has no CSV
file (:mod:`trainmon.tools.store_reader`): the event files are the same as from that run's CSV files.

Also reads msprobe's CSV output (``$MONITOR_OUTPUT_DIR/{time}-rank{R}-{id}/{family}_{a}-{b}.csv``, msprobe
1.2 and 8.x-26.x layouts, see :mod:`trainmon.tools.msprobe_output`) and says which layout it read. This module
writes the event files; the rank folders and the sources of each rank are found by
:mod:`trainmon.tools.csv2tb_sources`, and reading and checking the CSV files is :mod:`trainmon.tools.readers`'s.
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

from trainmon.base.inputs import describe_os_error, find_runs, is_dir, open_regular, rank_dirs_of
from trainmon.base.progress import Bar
from trainmon.base.records import FAMILIES, ROW_METRICS, split_row_tag
from trainmon.errors import ConfigError, UsageError
from trainmon.sinks import tensorboard as board
from trainmon.sinks.tensorboard_overview import SCALAR_TAGS, Block, Overview, TagSelection
from trainmon.tools.csv2tb_sources import complete_steps, has_csv, layouts_of, sources_of
from trainmon.tools.msprobe_output import ANOMALY_FOLDER, rank_folders
from trainmon.tools.readers import CsvFormatError
from trainmon.tools.store_reader import (
    STORE_LAYOUT,
    StoreError,
    replica_note,
    replica_writers,
    source_family,
    source_scalars,
    source_tables,
)

if TYPE_CHECKING:
    from trainmon.tools.command import Subparsers

_MSPROBE_FAMILIES = ("other", "param_origin", "param_updated")


def add_parser(sub: Subparsers) -> None:
    parser = sub.add_parser("csv2tb", help="export a run's statistics to TensorBoard event files",
                            description="Export every rank's statistics of a run (its store/ or its CSV files) to "
                                        "TensorBoard event files, with the TensorBoard sink's tags: "
                                        "0_overview/{loss,grad_norm,lr,...}, anomalies as counts and text, and per "
                                        "family and metric summaries over the tensors of each step "
                                        "({family}/norm_max, norm_median, norm_argmax, ...: fewer than 200 tags "
                                        "whatever the model size); --per-tensor adds "
                                        "{family}/{name}/{metric}[/vpp{v}][/micro{m}] at full resolution. Also reads "
                                        "msprobe's CSV output (MONITOR_OUTPUT_DIR or one of its {time}-rank{R}-{id} "
                                        "folders).")
    parser.add_argument("run_dir", help="a run directory (with rank*/ folders or store/), one rank directory, "
                                        "or msprobe's output folder")
    parser.add_argument("-o", "--output", help="output directory (default: RUN_DIR/tensorboard)")
    parser.add_argument("--families", nargs="+", choices=[*FAMILIES, "scalars", *_MSPROBE_FAMILIES],
                        help="only these families (summaries and per-tensor tags; scalars: the step's scalars)")
    parser.add_argument("--metrics", nargs="+", choices=ROW_METRICS, help="only these metrics")
    parser.add_argument("--per-tensor", action="store_true",
                        help="also one tag per tensor and metric (thousands of tags on a large model: TensorBoard "
                             "loads them slowly; narrow them with --tensors)")
    parser.add_argument("--tensors", nargs="+", metavar="PATTERN",
                        help="with --per-tensor: only these tensors, by row name: exact names, globs "
                             "(layers.0.*) or re:REGEX (as the config's tensorboard.tensors)")
    parser.add_argument("--workers", type=int, default=2, help="ranks converted in parallel (default 2)")
    parser.set_defaults(func=_main)


def selection_of(per_tensor: bool, tensors: list[str] | None, metrics: list[str] | None) -> TagSelection:
    """The :class:`TagSelection` of the command's options.

    Raises:
        UsageError: ``--tensors`` without ``--per-tensor``, or a pattern that is empty or an invalid regex.
    """
    if tensors is not None and not per_tensor:
        raise UsageError("--tensors selects the per-tensor tags: add --per-tensor")
    try:
        return TagSelection(per_tensor, tensors or ["*"], None, metrics)
    except ConfigError as exc:
        raise UsageError(str(exc).replace("tensorboard.tensors", "--tensors", 1)) from None


def _main(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    selection = selection_of(args.per_tensor, args.tensors, args.metrics)
    run_dir = Path(args.run_dir)
    output = Path(args.output) if args.output else None
    jobs = [(run_dir, output)]
    if is_dir(run_dir) and not rank_dirs_of(run_dir) and not has_csv(run_dir):
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
            count, layouts, notes = _convert(run, out, args.families, args.workers, selection)
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


def convert(run_dir: Path, output: Path | None = None, families: list[str] | None = None, workers: int = 2,
            selection: TagSelection | None = None) -> int:
    """Export a run to ``{output}/{rank dir}/events.out.tfevents.*``; returns the number of scalars written.

    ``run_dir`` may also be msprobe's output folder or one of its rank folders (msprobe's CSV layouts).
    ``selection``: what is written beyond the overview (default: the overview alone, as the TensorBoard sink).

    Raises:
        FileNotFoundError: ``run_dir`` has no rank directories or CSV files.
        CsvFormatError: a malformed CSV (file and line in the message).
        StoreError: an unreadable part of the run's store (the file in the message).
        OutputError: the output cannot be written (a full disk, a read-only folder).
    """
    return _convert(run_dir, output, families, workers, selection)[0]


def _convert(run_dir: Path, output: Path | None, families: list[str] | None,
             workers: int, selection: TagSelection | None = None) -> tuple[int, set[str], list[str]]:
    """:func:`convert`, also returning the layouts read (``trainmon CSV``, ``msprobe 1.2 CSV``, ...) and a
    note per rank folder skipped because it holds nothing to convert."""
    from tensorboardX.summary import custom_scalars

    selection = selection or TagSelection()
    output = output or run_dir / "tensorboard"
    csv_files = sources_of(run_dir)
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
    dropped: list[str] = []

    def one(rank_dir: Path) -> int:
        # One Summary per (file, step), as the TensorBoard sink writes them: no per-value event, and
        # no warning per NaN (tensorboardX's add_scalar logs one; a monitor reports NaN quietly).
        writer = _Export(output / rank_dir.name, root=output)
        writer.open()
        overview = Overview(TagSelection(selection.per_tensor, selection.tensors, None, selection.metrics),
                            on_dropped=lambda name: dropped.append(f"{rank_dir.name}: {name!r}"))
        try:
            for source in wanted_files[rank_dir]:
                family = source_family(source)
                if family == "scalars":
                    writer.stream(source_scalars(source, layouts), lambda tag: overview.scalar_tags(
                        tag[8:], board.scalar_tags))
                    bar.advance()
                    continue
                if selection.per_tensor:
                    writer.stream(source_scalars(source, layouts), _per_tensor(selection))
                else:
                    layouts.update(layouts_of(source))
                for table in complete_steps(source_tables(source)):
                    writer.blocks(overview.blocks(family, table.metrics, table.keys, table.rows, table.micro_steps,
                                                  table.steps, table.values))
                bar.advance()
            writer.blocks(overview.finish())
            if families is None:  # anomalies as the TensorBoard sink writes them: counts and text at their step
                for step, (counts, texts) in board.anomaly_summaries(_anomaly_events(rank_dir)).items():
                    writer.write_summary(step, board.anomaly_summary(counts, texts))
                    writer.count += len(counts)
            if writer.tags:
                writer.write_summary(0, custom_scalars(board.custom_scalar_layout(sorted(writer.tags))))
        finally:
            writer.close()
        return writer.count

    with Bar(sum(map(len, wanted_files.values())), "csv2tb") as bar, \
            ThreadPoolExecutor(max_workers=min(workers, len(ranks))) as pool:
        count = sum(pool.map(one, ranks))
    if dropped:
        notes.append(f"the overview writes at most {SCALAR_TAGS} scalar tags per rank: {dropped[0]} and later new "
                     f"scalars were left out ({len(dropped)} rank{'s' if len(dropped) > 1 else ''}); "
                     "--per-tensor writes every scalar")
    return count, layouts, notes


def _per_tensor(selection: TagSelection) -> Any:
    """``tag -> [tag]`` when the per-tensor tag is selected, else ``[]`` (remembered per tag)."""
    chosen: dict[str, list[str]] = {}

    def tags(tag: str) -> list[str]:
        found = chosen.get(tag)
        if found is None:
            row = split_row_tag(tag)
            found = chosen[tag] = [tag] if row is not None and selection.tensor_tag(row[0], row[1], row[2]) else []
        return found

    return tags



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


class _Export(_EventOutput):
    """One rank's event file of the export: one ``Summary`` per source and step, the tags written and their count."""

    def __init__(self, directory: Path, root: Path | None = None) -> None:
        super().__init__(directory, root)
        self.tags: set[str] = set()
        self.count = 0

    def stream(self, rows: Iterator[tuple[str, float, int]], tags_of: Any) -> None:
        """``(tag, value, step)`` rows, each under the tags ``tags_of(tag)`` gives, one ``Summary`` per run of rows
        of one step."""
        value_of = self._summary.Value
        values: list[Any] = []
        current = 0
        for tag, value, step in rows:
            if step != current and values:
                self.write_summary(current, self._summary(value=values))
                values = []
            current = step
            for alias in tags_of(tag):
                values.append(value_of(tag=alias, simple_value=value))
                self.tags.add(alias)
                self.count += 1
        if values:
            self.write_summary(current, self._summary(value=values))

    def blocks(self, blocks: list[Block]) -> None:
        """The overview's blocks: the values of each step as one ``Summary``, the tables as text."""
        value_of = self._summary.Value
        for step, numbers, texts in blocks:
            if numbers:
                self.write_summary(step, self._summary(value=[value_of(tag=tag, simple_value=value)
                                                              for tag, value in numbers.items()]))
                self.tags.update(numbers)
                self.count += len(numbers)
            if texts:
                self.write_summary(step, board.text_summary(texts))


def _anomaly_events(rank_dir: Path) -> list[dict[str, Any]]:
    """The events of ``rank_dir/anomalies.jsonl`` (none when there is no such file)."""
    try:
        with open_regular(rank_dir / board.ANOMALIES_FILE) as handle:
            return board.read_anomaly_lines(handle.read())
    except FileNotFoundError:
        return []


__all__ = ["OutputError", "add_parser", "convert"]
