"""``trainmon analyse RUN_DIR``: the command that merges every rank's anomaly events and shows the first
non-finite value and the first spike; on a run with a store, also the first non-finite row, the spread of each
tensor's norm across ranks and the ranks that deviate most.

Arguments, the printed summary and tables, and ``anomaly_analyse.json`` (never over a file trainmon did not
write). A run with a store (``sinks: [parquet]``, or ``trainmon convert``) is analysed in SQL
(:mod:`trainmon.tools.store_analyse`); a run without one by merging its ``anomalies.jsonl`` files
(:mod:`trainmon.anomaly.merge`'s :func:`analyse_run`, whose names are re-exported here); msprobe's anomaly
events are read by :mod:`trainmon.tools.msprobe_output`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec

from trainmon.anomaly.events import decode_float
from trainmon.anomaly.firsts import UnknownDetectorError
from trainmon.anomaly.merge import RANK_DIR, analyse_run, find_files, printable
from trainmon.anomaly.step_ranges import StepRanges, bounded_int, parse_steps
from trainmon.base.inputs import find_runs, is_dir, rank_dirs_of, read_regular, runs_hint
from trainmon.errors import UsageError
from trainmon.sinks.store_layout import STORE_DIR
from trainmon.tools.msprobe_output import ANOMALY_FOLDER, analyse_msprobe, anomaly_files, rank_folders
from trainmon.tools.store_reader import StoreError

if TYPE_CHECKING:
    from trainmon.tools.command import Subparsers

_P = ParamSpec("_P")
OUTPUT_NAME = "anomaly_analyse.json"
MSPROBE_OUTPUT_NAME = "trainmon_anomaly_analyse.json"
"""Written next to msprobe's own ``anomaly_analyse.json``, under another name."""
WRITTEN_BY = "trainmon analyse"


def format_table(events: list[dict[str, Any]]) -> str:
    """Plain-text table: rank, step, micro-step, phase, name, metric, value, detector."""
    header = ("rank", "step", "micro", "phase", "name", "metric", "value", "detector")
    rows = [header] + [(str(e["rank"]), str(e["step"]), str(e["micro_step"]), e["phase"], printable(e["name"]),
                        printable(e["metric"]), f"{decode_float(e['value']):.6g}", e["detector"]) for e in events]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def _steps_arg(text: str) -> StepRanges:
    try:
        return parse_steps(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def detectors_arg(text: str) -> list[str]:
    """``--detector`` value: one name or a comma list (``nonfinite,spike``)."""
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected detector names, e.g. nonfinite,spike, got {text[:50]!r}")
    return names


def selected_detectors(values: list[list[str]] | None) -> list[str] | None:
    """The names of every ``--detector`` (repeatable, each a comma list), or None when none was given."""
    return sorted({name for names in values for name in names}) if values else None


def add_detector_option(parser: argparse.ArgumentParser) -> None:
    """``--detector NAME`` (repeatable or a comma list), shared by ``analyse`` and ``report``."""
    parser.add_argument("--detector", dest="detectors", action="append", type=detectors_arg, metavar="NAME",
                        help="only the events of this detector (nonfinite, spike, loss_spike, growth, level, or "
                             "msprobe's rule names); repeat it or give a comma list")


def _positive(text: str) -> int:
    value = bounded_int(text.strip()) if text.strip().isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text[:50]!r}")
    return value


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    """Register ``analyse`` on the ``trainmon`` command's subparsers."""
    parser = subparsers.add_parser(
        "analyse", help="merge every rank's anomalies.jsonl and show the earliest anomalies",
        description="Merge rank*/anomalies.jsonl of a run, order events earliest first (step, micro-step, "
                    "phase, pipeline stage, execution order), name the first non-finite value and the first spike, "
                    "print the top K and write anomaly_analyse.json. A run with a store (sinks: [parquet], or "
                    "trainmon convert) is analysed in SQL (DuckDB), which also names the first non-finite row, the "
                    "largest spreads of a tensor's norm across ranks and the ranks that deviate most. "
                    "Also reads msprobe's anomaly events (MONITOR_OUTPUT_DIR/anomaly_detected/rank*/anomaly.json), "
                    f"ordered by msprobe's rule, and writes {MSPROBE_OUTPUT_NAME} next to them. "
                    "A file trainmon did not write is never overwritten.")
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="run directory holding rank{R}/anomalies.jsonl, or msprobe's output folder")
    parser.add_argument("--top", type=_positive, default=20, metavar="K", help="events to show (default 20)")
    parser.add_argument("--steps", type=_steps_arg, default=None, help="only these steps, e.g. 1,3,5-9")
    add_detector_option(parser)
    parser.add_argument("-o", "--output", default=None, metavar="OUT",
                        help=f"directory (or .json file) for {OUTPUT_NAME}; default RUN_DIR")
    parser.set_defaults(func=run_cli)
    return parser


def run_cli(args: argparse.Namespace) -> int:
    """The ``analyse`` command; returns the exit code.

    Reads a trainmon run (``rank*/anomalies.jsonl``) or msprobe's anomaly events
    (``anomaly_detected/rank*/anomaly.json`` under ``$MONITOR_OUTPUT_DIR``) and says which it read.
    Never overwrites a file it did not write.

    Raises:
        UsageError: not a run directory (a folder of runs is listed with the one to pass), or the
            output cannot be written or is a file trainmon did not write.
    """
    run_dir = Path(args.run_dir)
    detectors = selected_detectors(args.detectors)
    if not is_dir(run_dir):
        what = "is not a directory" if os.path.lexists(run_dir) else "does not exist"
        raise UsageError(f"run directory {run_dir} {what}")
    store = has_store(run_dir)
    msprobe_files = [] if find_files(run_dir) else anomaly_files(run_dir)
    if msprobe_files:
        result = checked(analyse_msprobe, run_dir, msprobe_files, top=args.top, steps=args.steps, detectors=detectors)
        default_name = MSPROBE_OUTPUT_NAME
        runs = [run for run in find_runs(run_dir) if run.name != ANOMALY_FOLDER]
        print(f"read msprobe's anomaly events: {len(msprobe_files)} anomaly.json file"
              f"{'s' if len(msprobe_files) != 1 else ''} ({', '.join(printable(str(p)) for p in msprobe_files[:3])}"
              f"{', ...' if len(msprobe_files) > 3 else ''}), ordered by msprobe's rule; names are msprobe's")
        if runs:
            print(f"note: {run_dir} also holds trainmon runs; analyse one with: trainmon analyse {runs[-1]}")
        result.update(_store_rows(run_dir, args.top, args.steps) if store else NO_ROWS)
    elif store:
        result = checked(_analyse_store, run_dir, top=args.top, steps=args.steps, detectors=detectors)
        default_name = OUTPUT_NAME
        print(f"read trainmon's anomaly events and rows from the store (SQL): {result['files']} rank"
              f"{'s' if result['files'] != 1 else ''} with events under {printable(str(run_dir))}")
    else:
        if not rank_dirs_of(run_dir) and not os.path.lexists(run_dir / "anomalies.jsonl"):
            runs = find_runs(run_dir)
            if runs:
                raise UsageError(runs_hint(run_dir, runs, "analyse"))
            if rank_folders(run_dir):
                raise UsageError(f"{run_dir} is msprobe output without anomaly events (msprobe writes "
                                 f"{ANOMALY_FOLDER}/rank*/anomaly.json only with alert.dump: true)")
            if not RANK_DIR.match(run_dir.name):
                raise UsageError(f"{run_dir} is not a run directory (no rank*/ folders)")
        result = checked(analyse_run, run_dir, top=args.top, steps=args.steps, progress=True, detectors=detectors)
        result.update(NO_ROWS)
        default_name = OUTPUT_NAME
        print(f"read trainmon's anomaly events: {result['files']} rank*/anomalies.jsonl file"
              f"{'s' if result['files'] != 1 else ''} under {printable(str(run_dir))}")
    result = {"written_by": WRITTEN_BY, **result}
    out = Path(args.output) if args.output else run_dir
    target = out if out.suffix == ".json" else out / default_name
    _refuse_foreign(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    except (OSError, ValueError) as exc:
        reason = exc.strerror or str(exc) if isinstance(exc, OSError) else str(exc)
        raise UsageError(f"cannot write {target}: {reason}") from None
    for item in result["corrupt"][:20]:
        where, what = (f":{item['line']}", "corrupt line") if item["line"] else ("", "file")
        print(f"warning: {run_dir / item['file']}{where}: {what} skipped: {item['error']}", file=sys.stderr)
    if result["corrupt_total"] > 20:
        print(f"warning: {result['corrupt_total'] - 20} more corrupt lines (see {target})", file=sys.stderr)
    if not result["files"]:
        print(f"no {'anomaly events' if store else 'rank*/anomalies.jsonl'} under {run_dir}: no anomalies recorded")
    elif not result["top"]:
        print(f"no anomalies{' in the selected steps' if args.steps is not None else ''}"
              f"{' from the selected detectors' if detectors else ''}")
    else:
        first = result["first_origin"]
        print(f"{result['events']} anomalies in {result['files']} files; first origin: {printable(first['message'])}")
        for title, key in (("first non-finite", "first_nonfinite"), ("first spike", "first_spike")):
            print(f"{title}: {_headline(result[key])}")
        print(format_table(result["top"]))
    print_rows(result)
    print(f"wrote {target}")
    return 0


NO_ROWS: dict[str, Any] = {"first_nonfinite_row": None, "nonfinite_rows": None, "spread": None,
                           "deviating_ranks": None}
"""The row sections of a run without a store (null in ``anomaly_analyse.json``)."""


def _analyse_store(run_dir: Path, top: int, steps: StepRanges | None,
                   detectors: list[str] | None) -> dict[str, Any]:
    from trainmon.tools.store_analyse import analyse_store  # duckdb: only for a run with a store

    try:
        return analyse_store(run_dir, top=top, steps=steps, detectors=detectors)
    except StoreError as exc:
        raise UsageError(str(exc)) from None


def _store_rows(run_dir: Path, top: int, steps: StepRanges | None) -> dict[str, Any]:
    from trainmon.tools.store_analyse import store_rows

    try:
        return store_rows(run_dir, top=top, steps=steps)
    except StoreError as exc:
        raise UsageError(str(exc)) from None


def _number(value: Any) -> str:
    return f"{decode_float(value):.4g}" if value is not None else "-"


def print_rows(result: dict[str, Any]) -> None:
    """The row sections: the first non-finite row, the largest spreads and the deviating ranks (or, on a run
    without a store, how to get them)."""
    if result.get("spread") is None:
        print(f"no store: `trainmon convert {printable(result['run_dir'])}` writes one; analyse then also names the "
              "first non-finite row, the spread of each tensor across ranks and the ranks that deviate most")
        return
    first, counted = result["first_nonfinite_row"], result["nonfinite_rows"]
    if first is None:
        print("first non-finite row: none")
    else:
        print(f"first non-finite row: {printable(first['message'])} ({first['family']}, order {first['order']}; "
              f"{counted['rows']} non-finite rows on {counted['ranks']} rank{'s' if counted['ranks'] != 1 else ''})")
    spread = result["spread"]
    if not spread:
        print("spread across ranks: none (no tensor's norm is recorded by 2 ranks or more)")
    else:
        print(f"largest spreads of a tensor's norm across ranks ((max - min) / |median|, top {len(spread)}):")
        header: tuple[str, ...] = ("step", "micro", "family", "name", "ranks", "min", "median", "max", "relative",
                                   "min rank", "max rank")
        rows: list[tuple[str, ...]] = [
            (str(g["step"]), str(g["micro_step"]), str(g["family"]), printable(g["name"]), str(g["ranks"]),
             _number(g["min"]), _number(g["median"]), _number(g["max"]), _number(g["relative_spread"]),
             str(g["min_rank"]), str(g["max_rank"])) for g in spread]
        print(_aligned(header, rows))
    deviating = result["deviating_ranks"]
    if not deviating["groups"]:
        print(f"deviating ranks: none (robust z needs a tensor recorded by {deviating['min_ranks']} ranks or more "
              "whose norms differ)")
        return
    print(f"ranks that deviate most (robust z of the norm across ranks; outlier: the farthest rank with |z| >= "
          f"{deviating['threshold']}, in {deviating['groups_with_outlier']} of {deviating['groups']} groups):")
    header = ("rank", "outliers", "groups", "mean |z|", "max |z|", "at")
    rows = [(str(r["rank"]), str(r["outliers"]), str(r["groups"]), _number(r["mean_abs_z"]), _number(r["max_abs_z"]),
             f"step {r['worst']['step']} {r['worst']['family']} {printable(r['worst']['name'])}")
            for r in deviating["ranks"]]
    print(_aligned(header, rows))


def _aligned(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    table = [header, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in table)


def has_store(run_dir: Path) -> bool:
    """Whether ``run_dir`` (a run or msprobe's output folder, not a rank folder) has a ``store/`` folder."""
    return not RANK_DIR.match(run_dir.name) and is_dir(run_dir / STORE_DIR)


def _headline(event: dict[str, Any] | None) -> str:
    """``step 60, rank 0 [nonfinite]: <message>``, or ``none``."""
    if event is None:
        return "none"
    return f"step {event['step']}, rank {event['rank']} [{printable(event['detector'])}]: {printable(event['message'])}"


def checked(analyse: Callable[_P, dict[str, Any]], *args: _P.args, **kwargs: _P.kwargs) -> dict[str, Any]:
    """``analyse(*args, **kwargs)`` with an unknown ``--detector`` name as a usage error (exit 2, one line)."""
    try:
        return analyse(*args, **kwargs)
    except UnknownDetectorError as exc:
        raise UsageError(f"--detector: {exc}") from None


def _refuse_foreign(target: Path) -> None:
    """Raise unless ``target`` is absent or was written by ``trainmon analyse`` (e.g. msprobe's own
    ``anomaly_analyse.json`` is never overwritten).

    Raises:
        UsageError: ``target`` exists and is not trainmon's.
    """
    if not os.path.lexists(target):
        return
    try:
        data = json.loads(read_regular(target).decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        data = None
    ours = isinstance(data, dict) and (data.get("written_by") == WRITTEN_BY
                                       or {"first_origin", "top", "counts"} <= set(data))
    if not ours:
        raise UsageError(f"{target} exists and was not written by trainmon analyse (msprobe's own "
                         f"{OUTPUT_NAME}?); it is left as it is: pass -o to write elsewhere")


__all__ = ["MSPROBE_OUTPUT_NAME", "NO_ROWS", "OUTPUT_NAME", "WRITTEN_BY", "add_detector_option", "add_parser",
           "checked", "detectors_arg", "format_table", "has_store", "print_rows", "run_cli", "selected_detectors"]
