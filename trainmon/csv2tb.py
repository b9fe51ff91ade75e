"""``trainmon csv2tb``: convert a run's CSV files to TensorBoard event files (framework-free)."""

from __future__ import annotations

import argparse
import csv
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainmon.errors import UsageError
from trainmon.progress import progress
from trainmon.records import FAMILIES

_FIXED = ("vpp_stage", "name", "step", "micro_step")


class CsvFormatError(ValueError):
    """A CSV file is malformed; the message names the file and line."""


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("csv2tb", help="convert CSV output to TensorBoard event files",
                            description="Convert every rank's CSV files of a run to TensorBoard event files "
                                        "at full resolution (tags {family}/{name}/{metric}).")
    parser.add_argument("run_dir", help="a run directory (with rank*/ folders) or one rank directory")
    parser.add_argument("-o", "--output", help="output directory (default: RUN_DIR/tensorboard)")
    parser.add_argument("--families", nargs="+", choices=[*FAMILIES, "scalars"], help="only these families")
    parser.add_argument("--workers", type=int, default=2, help="ranks converted in parallel (default 2)")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:

    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    run_dir = Path(args.run_dir)
    try:
        written = convert(run_dir, Path(args.output) if args.output else None, args.families, args.workers)
    except (FileNotFoundError, CsvFormatError) as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:  # e.g. an unwritable --output
        raise UsageError(f"{exc.filename or args.output}: {exc.strerror or exc}") from None
    print(f"wrote {written} scalars to {Path(args.output) if args.output else run_dir / 'tensorboard'}")
    return 0


def rank_dirs(run_dir: Path) -> list[Path]:
    """The ``rank*`` directories of a run (or the directory itself if it is one)."""
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such directory")
    ranks = sorted((p for p in run_dir.glob("rank*") if p.is_dir()), key=lambda p: (len(p.name), p.name))
    if not ranks and any(run_dir.glob("*.csv")):
        return [run_dir]
    if not ranks:
        raise FileNotFoundError(f"{run_dir}: no rank*/ directories and no CSV files")
    return ranks


def convert(run_dir: Path, output: Path | None = None, families: list[str] | None = None, workers: int = 2) -> int:
    """Convert CSVs to ``{output}/{rank dir}/events.out.tfevents.*``; returns the number of scalars.

    Raises:
        FileNotFoundError: ``run_dir`` has no rank directories or CSV files.
        CsvFormatError: a malformed CSV (file and line in the message).
    """
    from tensorboardX import FileWriter
    from tensorboardX.proto.summary_pb2 import Summary

    ranks = rank_dirs(run_dir)
    output = output or run_dir / "tensorboard"

    def one(rank_dir: Path) -> int:
        files = sorted(rank_dir.glob("*.csv"))
        wanted = [f for f in files if families is None or family_of(f) in families]
        # One Summary per (file, step), as the TensorBoard sink writes them: no per-value event, and
        # no warning per NaN (tensorboardX's add_scalar logs one; a monitor reports NaN quietly).
        writer = FileWriter(str(output / rank_dir.name), flush_secs=3600)
        count = 0
        try:
            for path in wanted:
                values: list[Any] = []
                current = None
                for tag, value, step in read_scalars(path):
                    if step != current and values:
                        writer.add_summary(Summary(value=values), current)
                        values = []
                    current = step
                    values.append(Summary.Value(tag=tag, simple_value=value))
                    count += 1
                if values:
                    writer.add_summary(Summary(value=values), current)
        finally:
            writer.close()
        return count

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return sum(progress(pool.map(one, ranks), len(ranks), "csv2tb"))


def family_of(path: Path) -> str:
    """``grad_reduced.csv`` and ``grad_reduced_120.csv`` (metrics changed at step 120) -> ``grad_reduced``."""
    head, _, tail = path.stem.rpartition("_")
    return head if head and tail.isdigit() else path.stem


def read_scalars(path: Path) -> Any:
    """Yield ``(tag, value, step)`` from one trainmon CSV file.

    Raises:
        CsvFormatError: a malformed or undecodable file (file and line in the message).
    """
    try:
        yield from _read_scalars(path, family_of(path))
    except UnicodeDecodeError as exc:
        raise CsvFormatError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except csv.Error as exc:
        raise CsvFormatError(f"{path}: {exc}") from None


def _read_scalars(path: Path, family: str) -> Any:
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None:
            return
        scalars = family == "scalars"
        if scalars and header != ["step", "name", "value"]:
            raise CsvFormatError(f"{path}:1: expected header step,name,value, got {','.join(header)}")
        if not scalars and tuple(header[:4]) != _FIXED:
            raise CsvFormatError(f"{path}:1: expected header to start with {','.join(_FIXED)}, got {','.join(header)}")
        for line, row in enumerate(reader, 2):
            if len(row) != len(header):
                raise CsvFormatError(f"{path}:{line}: expected {len(header)} fields, got {len(row)}")
            try:
                if scalars:
                    yield f"scalars/{row[1]}", float(row[2]), int(row[0])
                    continue
                step = int(row[2])
                for metric, text in zip(header[4:], row[4:]):
                    value = float(text)
                    yield f"{family}/{row[1]}/{metric}", value, step
            except ValueError as exc:
                raise CsvFormatError(f"{path}:{line}: {exc}") from None


__all__ = ["CsvFormatError", "add_parser", "convert"]
