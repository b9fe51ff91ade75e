"""``trainmon report RUN_DIR -o report.html``: one self-contained HTML report of a run (framework-free).

The page (no network needed to open it) shows the loss, grad-norm and learning-rate curves with
the steps of anomaly events marked, the cross-rank anomaly timeline with the first origin, the first
non-finite value and the first spike (from ``trainmon analyse``'s merge), module x step heatmaps per family,
metric and rank (log colour scale), and the gradient-direction heatmaps of the grad probe when the run has them. Reads
trainmon runs (their CSV files, or the run store of ``sinks: [parquet]``) and msprobe's CSV output folders, with
the readers of ``csv2tb`` and ``analyse``.
See docs/report.md.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainmon.anomaly.merge import analyse_run, find_files, parse_steps
from trainmon.base.inputs import describe_os_error, find_runs, is_dir, rank_dirs_of, runs_hint
from trainmon.base.progress import Bar
from trainmon.base.safe_io import write_atomic
from trainmon.errors import UsageError
from trainmon.tools.analyse import add_detector_option, checked, selected_detectors
from trainmon.tools.msprobe_output import ANOMALY_FOLDER, analyse_msprobe, anomaly_files, rank_folders
from trainmon.tools.readers import CsvFormatError
from trainmon.tools.report import data as report_data
from trainmon.tools.report.page import render
from trainmon.tools.store_reader import Source, StoreError, StoreFamily, replica_note, replica_writers, source_family

if TYPE_CHECKING:
    from trainmon.tools.command import Subparsers

DEFAULT_NAME = "report.html"
MAX_RANKS = 8
"""Ranks with heatmaps when ``--ranks`` is not given (the first ones; every rank is in the timeline)."""


def add_parser(sub: Subparsers) -> None:
    """Register ``report`` on the ``trainmon`` command's subparsers."""
    parser = sub.add_parser(
        "report", help="write one self-contained HTML report of a run",
        description="Write one HTML file (inline JavaScript, no network needed to open it) with the loss, grad-norm "
                    "and lr curves (anomalies marked), the cross-rank anomaly timeline with the first origin, the "
                    "first non-finite value and the first spike, "
                    "module x step heatmaps per family, metric and rank (log colour scale) and the grad-probe "
                    "direction heatmaps. Reads a trainmon run directory (its CSV files, or its store/ of sinks: "
                    "[parquet] where a family has no CSV file) or msprobe's CSV output folder.")
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="a run directory (with rank*/ folders) or one rank directory")
    parser.add_argument("-o", "--output", metavar="OUT", help=f"the HTML file (default RUN_DIR/{DEFAULT_NAME})")
    parser.add_argument("--ranks", type=_ranks_arg, default=None, metavar="R",
                        help=f"ranks with heatmaps and curves, e.g. 0,4-7 (default: the first {MAX_RANKS})")
    parser.add_argument("--families", nargs="+", metavar="FAMILY", help="only these families' heatmaps")
    parser.add_argument("--metrics", nargs="+", metavar="METRIC", help="only these metrics' heatmaps (e.g. norm nans)")
    parser.add_argument("--max-columns", type=_columns_arg, default=1000, metavar="N",
                        help="heatmap columns at most (default 1000): more collected steps are binned")
    add_detector_option(parser)
    parser.set_defaults(func=_main)


def _ranks_arg(text: str) -> Any:
    try:
        return parse_steps(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("step", "rank")) from None


def _columns_arg(text: str) -> int:
    if not text.strip().isdigit() or not 10 <= int(text) <= 100_000:
        raise argparse.ArgumentTypeError(f"must be an integer in 10..100000, got {text[:30]!r}")
    return int(text)


def _main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    output = Path(args.output) if args.output else run_dir / DEFAULT_NAME
    if is_dir(output):
        raise UsageError(f"--output {output} is a directory: name the HTML file, e.g. {output / DEFAULT_NAME}")
    summary = build(run_dir, output, ranks=args.ranks, families=args.families, metrics=args.metrics,
                    max_columns=args.max_columns, detectors=selected_detectors(args.detectors))
    for line in summary["warnings"]:
        print(f"warning: {line}", file=sys.stderr)
    stored, csv_count = summary["store_tables"], summary["files"] - summary["store_tables"]
    read = " and ".join([f"{csv_count} CSV files"] * bool(csv_count or not stored)
                        + [f"{stored} store tables"] * bool(stored))
    print(f"read {read} of {len(summary['ranks'])} rank(s)"
          f"{' and ' + str(summary['anomaly_files']) + ' anomaly file(s)' if summary['anomaly_files'] else ''}; "
          f"{summary['heatmaps']} heatmaps, {summary['curves']} curves, {summary['events']} anomaly events")
    print(f"wrote {output} ({summary['bytes'] / 1e6:.1f} MB) in {summary['seconds']:.1f} s")
    return 0


def build(run_dir: Path, output: Path, ranks: Any = None, families: list[str] | None = None,
          metrics: list[str] | None = None, max_columns: int = 1000, progress: bool | None = None,
          detectors: list[str] | None = None) -> dict[str, Any]:
    """Read ``run_dir``, write the report to ``output``; returns what it did (counts, bytes, seconds).

    Args:
        ranks: ranks with heatmaps and curves (a :class:`~trainmon.anomaly.merge.StepRanges` or
            ints; None: the first :data:`MAX_RANKS`).
        families: only these families' heatmaps (None: all).
        metrics: only these metrics' heatmaps (None: all).
        max_columns: heatmap columns at most; curves keep up to twice as many points.
        progress: draw a progress bar (None: when stderr is a terminal).
        detectors: only these detectors' anomaly events (None: all).

    Raises:
        UsageError: not a run directory, nothing to report, a corrupt CSV file (file and line in the
            message) or store part (the file), a detector that is none, or the output cannot be written.
    """
    start = time.perf_counter()
    if is_dir(run_dir) and not rank_dirs_of(run_dir) and not rank_folders(run_dir) and not any(run_dir.glob("*.csv")):
        runs = [run for run in find_runs(run_dir) if run.name != ANOMALY_FOLDER]
        if runs:
            raise UsageError(runs_hint(run_dir, runs, "report"))
    try:
        by_rank = report_data.sources(run_dir)
        writers = replica_writers(run_dir)  # families written once per data-parallel group: labelled as the group's
    except FileNotFoundError as exc:
        raise UsageError(str(exc) if exc.filename is None else describe_os_error(exc)) from None
    except StoreError as exc:
        raise UsageError(str(exc)) from None
    probe = report_data.probe_files(run_dir, sorted(by_rank))
    # A rank folder without CSV files or grad-probe summaries (an attach that failed, a rank that wrote
    # nothing yet) has no heatmap or curve: one warning names them, the others are reported.
    empty = [rank for rank, paths in by_rank.items() if not paths and rank not in probe]
    if len(empty) == len(by_rank):  # no rank has any: the anomalies alone, or nothing to report (below)
        empty = []
    skipped = [f"{run_dir}: skipped rank folder(s) {_ranks_text(sorted(empty))}: no CSV files"] if empty else []
    all_ranks = sorted(rank for rank in by_rank if rank not in empty)
    chosen = [r for r in all_ranks if r in ranks] if ranks is not None else all_ranks[:MAX_RANKS]
    notes = []
    if ranks is None and len(all_ranks) > MAX_RANKS:
        notes.append(f"heatmaps and curves of ranks {chosen[0]}..{chosen[-1]} of {len(all_ranks)} "
                     f"(trainmon report --ranks picks others); the anomaly timeline shows every rank")
    if ranks is not None and not chosen:
        raise UsageError(f"--ranks {ranks}: the run has ranks {_ranks_text(all_ranks)}")
    files = [path for rank in chosen for path in by_rank[rank]]
    probe = {rank: path for rank, path in probe.items() if rank in chosen}
    _check_families(run_dir, families, files)
    anomalies, anomaly_count = _anomalies(run_dir, max_columns, detectors)
    warnings = skipped + anomalies.pop("warnings", [])
    if not files and not probe and not anomaly_count:
        raise UsageError(f"{run_dir}: nothing to report (no CSV files, grad-probe summaries or anomaly events)")
    heatmaps: list[dict[str, Any]] = []
    probe_maps: list[dict[str, Any]] = []
    curves: dict[str, Any] = {}
    steps: list[int] = []
    read_metrics: set[str] = set()
    try:
        with Bar(len(files) + len(probe), "report", enabled=progress) as bar:
            for rank in chosen:
                tables, held = report_data.read_families(by_rank[rank], families, bar.advance, metrics)
                read_metrics |= held
                for family, family_tables in tables.items():
                    steps += [int(t.steps.min()) for t in family_tables if len(t.steps)]
                    steps += [int(t.steps.max()) for t in family_tables if len(t.steps)]
                    if family == "scalars":
                        curves[str(rank)] = report_data.curves(family_tables, 2 * max_columns)
                    else:
                        heatmaps += report_data.heatmaps(family, family_tables, rank, max_columns, metrics=metrics,
                                                         for_ranks=writers.get((family, rank)))
                if rank in probe:
                    table = report_data.read_probe_table(probe[rank])
                    probe_maps += report_data.heatmaps("grad_probe", [table], rank, max_columns,
                                                       scales=report_data.PROBE_METRICS)
                    bar.advance()
    except (CsvFormatError, StoreError) as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(describe_os_error(exc)) from None
    _check_choice("--metrics", metrics, read_metrics, run_dir, "metric of the --families" if families else "metric")
    replicated = replica_note({key: group for key, group in writers.items() if key[1] in chosen},
                              {h["family"] for h in heatmaps}, where="the heatmaps of rank")
    if replicated:
        notes.append(replicated)
    from trainmon.version import __version__

    page_data = {
        "summary": {"run_dir": str(run_dir), "run_name": run_dir.resolve().name, "trainmon": __version__,
                    "generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "files": len(files) + len(probe),
                    "first_step": min(steps) if steps else None, "last_step": max(steps) if steps else None},
        "ranks": chosen, "curves": curves, "heatmaps": heatmaps, "probe": probe_maps, "anomalies": anomalies,
        "notes": notes + [f"heatmaps: at most {max_columns} columns; a run with more collected steps is binned into "
                          "columns of consecutive collected steps, a cell holding the value of largest magnitude "
                          "(NaN/Inf win); grad-probe cells hold the lowest value",
                          f"curves: at most {2 * max_columns} points; beyond, the min and max of each bin (a band)"],
    }
    text = render(page_data).encode("utf-8")
    try:
        if output.parent != Path(""):
            output.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(output, text, root=output.parent)
    except OSError as exc:
        raise UsageError(f"cannot write {output}: {exc.strerror or exc}") from None
    return {"files": len(files) + len(probe), "store_tables": sum(isinstance(f, StoreFamily) for f in files),
            "ranks": chosen, "anomaly_files": anomalies.get("files", 0),
            "heatmaps": len(heatmaps) + len(probe_maps), "curves": sum(len(c) for c in curves.values()),
            "events": anomaly_count, "bytes": len(text), "seconds": time.perf_counter() - start,
            "warnings": warnings}


def _check_families(run_dir: Path, families: list[str] | None, files: list[Source]) -> None:
    """Raise unless every ``--families`` name is a family of the chosen ranks' CSV files (a typo would
    otherwise give an empty page, written over the last report).

    Raises:
        UsageError: a name that is no family of those files (naming the families there are).
    """
    _check_choice("--families", families, {source_family(source) for source in files}, run_dir, "family")


def _check_choice(option: str, given: list[str] | None, present: set[str], run_dir: Path, what: str) -> None:
    """Raise a one-line UsageError for the first of ``given`` not in ``present``, with a close name if any."""
    unknown = [name for name in given or [] if name not in present]
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], sorted(present), n=1)
    names = ", ".join(sorted(present)[:30]) + (", ..." if len(present) > 30 else "")
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise UsageError(f"{option} {unknown[0]}: no such {what} in {run_dir}{hint}; it has: {names or 'none'}")


def _anomalies(run_dir: Path, max_columns: int, detectors: list[str] | None) -> tuple[dict[str, Any], int]:
    """What the page shows of the anomalies (``analyse``'s merge), and the number of events."""
    if find_files(run_dir):
        result = checked(analyse_run, run_dir, top=20, progress=True, rank_steps=True, detectors=detectors)
    elif anomaly_files(run_dir):
        result = checked(analyse_msprobe, run_dir, anomaly_files(run_dir), top=20, detectors=detectors)
        by_step = result["counts"]["by_step"]
        result["counts"]["by_rank_step"] = [[e["rank"], e["step"], by_step[str(e["step"])]]
                                            for e in result["first_by_step"]]
    else:
        return {"present": False, "markers": [], "timeline": {"cells": [], "per_bin": 1}, "top": [],
                "first_origin": None, "first_nonfinite": None, "first_spike": None, "detectors": detectors,
                "events": 0, "files": 0, "by_detector": {}}, 0
    keep = ("step", "micro_step", "rank", "phase", "name", "metric", "value", "detector", "message")

    def slim(event: dict[str, Any] | None) -> dict[str, Any] | None:
        return {k: event.get(k) for k in keep} if event is not None else None

    warnings = [f"{run_dir / item['file']}{':' + str(item['line']) if item['line'] else ''}: skipped: {item['error']}"
                for item in result["corrupt"][:5]]
    return {"present": True, "events": result["events"], "files": result["files"],
            "by_detector": result["counts"]["by_detector"], "detectors": detectors,
            **{key: slim(result[key]) for key in ("first_origin", "first_nonfinite", "first_spike")},
            "top": [slim(event) for event in result["top"]], "markers": report_data.markers(result["first_by_step"]),
            "timeline": report_data.timeline(result, max_columns), "warnings": warnings}, result["events"]


def _ranks_text(ranks: list[int]) -> str:
    return ",".join(map(str, ranks[:20])) + (",..." if len(ranks) > 20 else "")


__all__ = ["add_parser", "build"]
