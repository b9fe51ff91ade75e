"""``trainmon report RUN_DIR -o report.html``: one self-contained HTML report of a run (framework-free).

The page (no network needed to open it) shows the loss, grad-norm and learning-rate curves with the steps of
anomaly events marked, the cross-rank anomaly timeline with the first origin, the first non-finite value and the
first spike (from ``trainmon analyse``'s merge), heatmaps in three views (module x step of a rank, module x rank at
a step, rank x step of a row: :mod:`.grids`) with rows grouped by layer and block (:mod:`.rows`), coloured by the
change against each row's running median or by the absolute value, and the gradient-direction heatmaps of the grad
probe when the run has them. The heatmaps and curves are queried with DuckDB (:mod:`.source`): from the run store
of ``sinks: [parquet]``, or from the CSV files of trainmon or msprobe taken in with the readers of ``csv2tb``; the
page holds the most telling grids within ``--max-size`` (:mod:`.plan`). ``trainmon serve`` shows the same views
for any grid, at full resolution. See docs/report.md.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainmon.anomaly.merge import analyse_run, find_files
from trainmon.anomaly.step_ranges import StepRanges, parse_steps
from trainmon.base.inputs import describe_os_error, find_runs, is_dir, rank_dirs_of, runs_hint
from trainmon.base.progress import Bar
from trainmon.base.safe_io import write_atomic
from trainmon.errors import UsageError
from trainmon.tools.analyse import add_detector_option, checked, selected_detectors
from trainmon.tools.msprobe_output import ANOMALY_FOLDER, analyse_msprobe, anomaly_files, rank_folders
from trainmon.tools.readers import CsvFormatError
from trainmon.tools.report import data as report_data
from trainmon.tools.report.curves import curves
from trainmon.tools.report.grids import CHANGE_RANGE, WINDOW
from trainmon.tools.report.page import render
from trainmon.tools.report.plan import Page, ordered_families, ordered_metrics, plan_page
from trainmon.tools.report.source import RunSource, open_source
from trainmon.tools.store_reader import Source, StoreError, replica_note, replica_writers, source_family
from trainmon.version import __version__

if TYPE_CHECKING:
    from trainmon.tools.command import Subparsers

DEFAULT_NAME = "report.html"
MAX_BYTES = 20_000_000
"""The page's size at most (``--max-size``, MB): heatmaps beyond it are left out, the most telling kept."""
MAX_CURVE_RANKS = 8
"""Ranks with curves and grad-probe heatmaps at most (the main rank first)."""


def add_parser(sub: Subparsers) -> None:
    """Register ``report`` on the ``trainmon`` command's subparsers."""
    parser = sub.add_parser(
        "report", help="write one self-contained HTML report of a run",
        description="Write one HTML file (inline JavaScript, no network needed to open it) with the loss, grad-norm "
                    "and lr curves (anomalies marked), the cross-rank anomaly timeline with the first origin, the "
                    "first non-finite value and the first spike, heatmaps (module x step of a rank, module x rank "
                    "at a step, rank x step of a module; rows grouped by layer and block; colour: change against "
                    "each row's running median, or the value on a log scale) with the anomaly events marked, and "
                    "the grad-probe direction heatmaps. Reads a trainmon run directory (its store/ of sinks: "
                    "[parquet], or its CSV files) or msprobe's CSV output folder. trainmon serve RUN_DIR shows "
                    "the same views for runs too large for one page.")
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="a run directory (with rank*/ folders or a store/) or one rank directory")
    parser.add_argument("-o", "--output", metavar="OUT", help=f"the HTML file (default RUN_DIR/{DEFAULT_NAME})")
    parser.add_argument("--ranks", type=_ranks_arg, default=None, metavar="R",
                        help="only these ranks, e.g. 0,4-7 (default: every rank; a CSV run's files of other ranks "
                             "are not read)")
    parser.add_argument("--families", nargs="+", metavar="FAMILY", help="only these families' heatmaps")
    parser.add_argument("--metrics", nargs="+", metavar="METRIC", help="only these metrics' heatmaps (e.g. norm nans)")
    parser.add_argument("--max-columns", type=_columns_arg, default=1000, metavar="N",
                        help="heatmap step columns at most (default 1000): more steps are bucketed, each cell the "
                             "min/max envelope of its steps")
    parser.add_argument("--max-size", type=_size_arg, default=MAX_BYTES // 1_000_000, metavar="MB",
                        help=f"the page's size at most, in MB (default {MAX_BYTES // 1_000_000}): heatmaps beyond it "
                             "are left out, the most telling kept")
    add_detector_option(parser)
    parser.set_defaults(func=_main)


def _ranks_arg(text: str) -> Any:
    try:
        return parse_steps(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("step", "rank")) from None


def _size_arg(text: str) -> int:
    if not text.strip().isdigit() or not 1 <= int(text) <= 2000:
        raise argparse.ArgumentTypeError(f"must be an integer in 1..2000 (MB), got {text[:30]!r}")
    return int(text)


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
                    max_columns=args.max_columns, detectors=selected_detectors(args.detectors),
                    max_bytes=args.max_size * 1_000_000)
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
          detectors: list[str] | None = None, max_bytes: int = MAX_BYTES) -> dict[str, Any]:
    """Read ``run_dir``, write the report to ``output``; returns what it did (counts, bytes, seconds).

    Args:
        ranks: only these ranks (a :class:`~trainmon.anomaly.step_ranges.StepRanges` or ints; None: every rank).
        families: only these families' heatmaps (None: all).
        metrics: only these metrics' heatmaps (None: all).
        max_columns: heatmap step columns at most; curves keep up to twice as many points.
        progress: draw a progress bar (None: when stderr is a terminal).
        detectors: only these detectors' anomaly events (None: all).
        max_bytes: the page's size at most (heatmaps are left out beyond it, the most telling kept).

    Raises:
        UsageError: not a run directory, nothing to report, a corrupt CSV file (file and line in the
            message) or store part (the file), a family, metric, rank or detector that is none, or the output
            cannot be written.
    """
    start = time.perf_counter()
    prepared = prepare(run_dir, ranks, families, max_columns, detectors, "report")
    with Bar(len(prepared.sources) + len(prepared.probe) + 12, "report", enabled=progress) as bar:
        source = open_prepared(prepared, families, bar.advance)
        try:
            data, grid_count = page_data(source, prepared, metrics, families, max_columns, max_bytes, bar.advance)
        finally:
            source.close()
    text = render(data).encode("utf-8")
    try:
        if output.parent != Path(""):
            output.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(output, text, root=output.parent)
    except OSError as exc:
        raise UsageError(f"cannot write {output}: {exc.strerror or exc}") from None
    return {"files": source.csv_files + source.store_tables + len(prepared.probe), "store_tables": source.store_tables,
            "ranks": data["ranks"], "anomaly_files": prepared.anomalies.get("files", 0),
            "heatmaps": grid_count + len(data["probe"]),
            "curves": sum(len(c) for c in data["curves"].values()), "events": prepared.events,
            "bytes": len(text), "seconds": time.perf_counter() - start, "warnings": prepared.warnings}


@dataclass
class Prepared:
    """A run checked and its anomalies merged, before its statistics are opened (:func:`prepare`).

    Attributes:
        run_dir: the run directory.
        by_rank: each rank's sources (CSV files, store families), empty rank folders left out.
        sources: the sources of the ranks asked for.
        ranks: the ranks asked for (None: all).
        probe: the grad-probe summaries of those ranks.
        anomalies: what the page shows of the anomalies.
        events: the number of anomaly events.
        warnings: lines for stderr.
    """

    run_dir: Path
    by_rank: dict[int, list[Source]]
    sources: list[Source]
    ranks: StepRanges | None
    probe: dict[int, Path]
    anomalies: dict[str, Any]
    events: int
    warnings: list[str]


def prepare(run_dir: Path, ranks: Any, families: list[str] | None, max_columns: int, detectors: list[str] | None,
            command: str) -> Prepared:
    """Check the run and the options, and merge its anomaly events.

    Raises:
        UsageError: not a run directory (a folder of runs names them, for ``command``), nothing to report, a rank
            or family that is none, a detector that is none.
    """
    if is_dir(run_dir) and not rank_dirs_of(run_dir) and not rank_folders(run_dir) and not any(run_dir.glob("*.csv")):
        runs = [run for run in find_runs(run_dir) if run.name != ANOMALY_FOLDER]
        if runs:
            raise UsageError(runs_hint(run_dir, runs, command))
    try:
        by_rank = report_data.sources(run_dir)
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
    if ranks is not None and not isinstance(ranks, StepRanges):
        ranks = StepRanges.of(ranks)
    _check_ranks(ranks, all_ranks, run_dir)
    by_rank = {rank: sources for rank, sources in by_rank.items() if rank not in empty}
    chosen = [s for rank, sources in by_rank.items() if ranks is None or rank in ranks for s in sources]
    _check_families(run_dir, families, chosen)
    anomalies, count = _anomalies(run_dir, max_columns, detectors)
    warnings = skipped + anomalies.pop("warnings", [])
    probe = {rank: path for rank, path in probe.items() if ranks is None or rank in ranks}
    if not chosen and not probe and not count:
        raise UsageError(f"{run_dir}: nothing to report (no CSV files, grad-probe summaries or anomaly events)")
    return Prepared(run_dir, by_rank, chosen, ranks, probe, anomalies, count, warnings)


def open_prepared(prepared: Prepared, families: list[str] | None, on_file: Callable[[], None]) -> RunSource:
    """The run as a DuckDB connection (:func:`~trainmon.tools.report.source.open_source`), errors as UsageError."""
    try:
        return open_source(prepared.run_dir, prepared.by_rank, ranks=prepared.ranks, families=families,
                           on_file=on_file)
    except (CsvFormatError, StoreError) as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(describe_os_error(exc)) from None


def page_data(source: RunSource, prepared: Prepared, metrics: list[str] | None, families: list[str] | None,
              max_columns: int, max_bytes: int, on_query: Callable[[], None] = lambda: None,
              serve: bool = False) -> tuple[dict[str, Any], int]:
    """What the page shows (:func:`~trainmon.tools.report.page.render`'s data); and the number of heatmaps.

    Args:
        serve: for ``trainmon serve``: no heatmap in the page (the page asks for them) and the main rank's curves
            alone (the others when asked).

    Raises:
        UsageError: a metric that is none, or the data cannot be read.
    """
    run_dir, anomalies, probe = prepared.run_dir, prepared.anomalies, prepared.probe
    present = {metric for family in source.families.values() for metric in family.metrics}
    _check_choice("--metrics", metrics, present, run_dir, "metric of the --families" if families else "metric")
    metrics_of = {name: ordered_metrics([m for m in family.metrics if metrics is None or m in metrics])
                  for name, family in source.families.items()}
    ranks = source.all_ranks
    origin = anomalies.get("first_origin")
    main_rank = origin["rank"] if origin and origin.get("rank") in ranks else (ranks[0] if ranks else 0)
    try:
        curve_ranks = ([main_rank] if main_rank in source.scalar_ranks else []) + [
            r for r in source.scalar_ranks if r != main_rank][:MAX_CURVE_RANKS - 1]
        if serve:
            curve_ranks = curve_ranks[:1]
        curve_data = {str(rank): curves(source, rank, 2 * max_columns) for rank in sorted(curve_ranks)}
        if serve:
            curve_data.update({str(rank): {} for rank in source.scalar_ranks if str(rank) not in curve_data})
        on_query()
        probe_maps = _probe_maps(probe, main_rank, max_columns, max_bytes // 4)
        data: dict[str, Any] = {
            "summary": {"run_dir": str(run_dir), "run_name": run_dir.resolve().name, "trainmon": __version__,
                        "generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        "files": source.csv_files + source.store_tables + len(probe),
                        "first_step": min((f.first_step for f in source.families.values()), default=None),
                        "last_step": max((f.last_step for f in source.families.values()), default=None)},
            "serve": serve, "ranks": ranks, "curves": curve_data, "probe": probe_maps, "anomalies": anomalies,
            "catalog": catalog(source, metrics_of, main_rank, max_columns), "grids": [], "rowsets": {}}
        base = len(render(data).encode("utf-8"))
        page = Page() if serve else plan_page(source, metrics_of, main_rank, anomalies, max_columns,
                                              max(0, max_bytes - base - 4096), on_query)
    except (CsvFormatError, StoreError) as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(describe_os_error(exc)) from None
    data["grids"], data["rowsets"] = page.grids, page.rowsets
    notes = [f"heatmaps: at most {max_columns} step columns; a run with more steps is cut into buckets of equal "
             "width, a cell holding the largest and the smallest magnitude of its steps, micro-steps (and ranks "
             "beyond 512): a one-step spike or drop is never averaged away, and NaN/Inf win",
             f"curves: at most {2 * max_columns} points; beyond, the min and max of each bucket (a band)"]
    if page.left_out:
        notes.append(f"{page.left_out} heatmap(s) left out to keep the page under {max_bytes / 1e6:.0f} MB "
                     "(--max-size); trainmon serve RUN shows every one, or pick with --ranks, --families, --metrics")
    if len(source.scalar_ranks) > len(curve_ranks) and not serve:
        notes.append(f"curves of {len(curve_ranks)} of {len(source.scalar_ranks)} ranks (--ranks picks others)")
    # families written once per data-parallel group: every rank's cells are its group writer's rows (open_run's views)
    replicated = replica_note(replica_writers(run_dir), where="the rows of rank")
    if replicated:
        notes.append(replicated)
    data["notes"] = notes
    return data, len(page.grids)


def catalog(source: RunSource, metrics_of: dict[str, list[str]], main_rank: int, max_columns: int) -> dict[str, Any]:
    """What the run holds (families, their metrics, ranks and steps) and the view shown first."""
    families = ordered_families([f for f in metrics_of if metrics_of[f]])
    default = families[0] if families else None
    return {"families": {name: {"metrics": metrics_of[name], "ranks": source.families[name].ranks,
                                "first_step": source.families[name].first_step,
                                "last_step": source.families[name].last_step} for name in families},
            "default": {"family": default, "metric": metrics_of[default][0] if default else None, "rank": main_rank},
            "columns": max_columns, "change_range": CHANGE_RANGE, "window": WINDOW}


def _probe_maps(probe: dict[int, Path], main_rank: int, max_columns: int, budget: int) -> list[dict[str, Any]]:
    """The grad-probe direction heatmaps, the main rank's first, ranks added while within ``budget`` bytes."""
    maps: list[dict[str, Any]] = []
    used = 0
    for rank in sorted(probe, key=lambda r: (r != main_rank, r))[:MAX_CURVE_RANKS]:
        table = report_data.read_probe_table(probe[rank])
        found = report_data.heatmaps("grad_probe", [table], rank, max_columns, scales=report_data.PROBE_METRICS)
        size = sum(len(m["data"]) for m in found)
        if maps and used + size > budget:
            break
        maps += found
        used += size
    return maps


def _check_ranks(ranks: StepRanges | None, present: list[int], run_dir: Path) -> None:
    """Raise unless every single rank and every range of ``--ranks`` names a rank of the run.

    Raises:
        UsageError: one line naming the first that does not, and the run's ranks.
    """
    if ranks is None:
        return
    for low, high in ranks.ranges:
        if not any(low <= rank <= high for rank in present):
            text = str(low) if low == high else f"{low}-{high}"
            raise UsageError(f"--ranks {text}: the run has ranks {_ranks_text(present)} ({run_dir})")


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
    keep = ("step", "micro_step", "rank", "phase", "family", "name", "vpp_stage", "metric", "value", "detector",
            "message")

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


__all__ = ["Prepared", "add_parser", "build", "catalog", "open_prepared", "page_data", "prepare"]
