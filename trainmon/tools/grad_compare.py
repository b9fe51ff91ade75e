"""``trainmon grad-compare RUN_A RUN_B -o OUT``: gradient-direction similarity of two runs (framework-free).

A run's directions are read from its direction files (``rank*/grad_probe/step*/*.bits``) and from its store's
``grad_directions`` table (:mod:`trainmon.probe.store`), so a run of either layout compares with one of the other.
Ranks, steps and parameters are matched by their numbers and names; the similarity of a
parameter at a step is the fraction of its stored elements whose gradient signs (``x > 0``)
are equal in both runs. Mismatches (a rank, step or parameter in one run only, different
shapes or samples, unreadable direction files) are listed in ``OUT/problems.txt`` and on stderr,
never fatal; only runs with nothing at all to compare end with exit code 2.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from trainmon.base.inputs import find_runs, is_dir, rank_dirs_of, runs_hint
from trainmon.base.progress import progress
from trainmon.errors import UsageError
from trainmon.probe.storage import PROBE_DIR, Direction, DirectionFormatError, read_direction_header
from trainmon.probe.store import scan_directions
from trainmon.sinks.store_layout import GRAD_DIRECTIONS, STORE_DIR

if TYPE_CHECKING:
    from trainmon.tools.command import Subparsers

_CONTROL = {code: f"\\x{code:02x}" for code in (*range(32), 127)}  # problems name user data: print it escaped
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)
SIMILARITY_COLUMNS = ("kind", "rank", "step", "vpp_stage", "name", "count", "similarity")
"""``kind`` is ``param``, or ``element_weighted`` / ``param_averaged`` for a step's summary rows."""

Tree = dict[int, dict[int, dict[tuple[int, str], Direction]]]


@dataclass
class Comparison:
    """What :func:`compare` found: similarity rows and human-readable problems."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def add_parser(sub: Subparsers) -> None:
    """Register ``grad-compare`` on the ``trainmon`` command's subparsers."""
    parser = sub.add_parser(
        "grad-compare", help="compare the gradient directions of two runs",
        description="Match ranks, steps and parameters of two runs' grad-probe direction files (level L1 or L2) "
                    "and write OUT/similarities.csv (fraction of equal gradient signs per parameter per step, "
                    "plus element-weighted and parameter-averaged rows per step) and PNG plots.")
    parser.add_argument("run_a", help="first run directory (with rank*/grad_probe/ or store/grad_directions/)")
    parser.add_argument("run_b", help="second run directory")
    parser.add_argument("-o", "--output", required=True, help="output directory")
    parser.add_argument("--no-plots", action="store_true", help="write only similarities.csv")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if not args.no_plots:
        try:
            import matplotlib  # noqa: F401  (checked before the work, not after it)
        except ImportError:
            raise UsageError("plots need matplotlib: pip install 'trainmon[plots]', or pass --no-plots") from None
    unreadable: list[str] = []
    try:
        tree_a, tree_b = scan_run(Path(args.run_a), unreadable), scan_run(Path(args.run_b), unreadable)
    except FileNotFoundError as exc:
        reason = f"{exc}; {len(unreadable)} unreadable: {unreadable[0]}" if unreadable else str(exc)
        raise UsageError(reason) from None
    result = compare(tree_a, tree_b)
    result.problems[:0] = unreadable
    if not result.rows:
        raise UsageError(f"nothing in common to compare: {result.problems[0] if result.problems else 'no data'}")
    out = Path(args.output)
    try:
        written = write_outputs(result, out, plots=not args.no_plots)
    except OSError as exc:  # an unwritable -o, or -o naming a file
        where = "" if exc.filename in (None, str(out)) else f"{exc.filename}: "
        raise UsageError(f"cannot write to {out}: {where}{exc.strerror or exc}") from None
    for line in result.problems[:10]:
        print(f"warning: {line}".translate(_CONTROL), file=sys.stderr)
    if len(result.problems) > 10:
        print(f"warning: ... and {len(result.problems) - 10} more, see {out / 'problems.txt'}", file=sys.stderr)
    params = sum(1 for row in result.rows if row["kind"] == "param")
    print(f"compared {params} parameter-steps; wrote {len(written)} files to {out}:")
    for path in written:
        print(f"  {path}".translate(_CONTROL))
    return 0


def scan_run(run_dir: Path, problems: list[str] | None = None) -> Tree:
    """``rank -> step -> (vpp_stage, name) -> Direction`` of a run (or of one rank directory): its direction
    files and the rows of its store's ``grad_directions`` table (a step of a parameter in both: the file's).

    Args:
        run_dir: the run (``rank*/grad_probe/``, ``store/grad_directions/``) or one rank directory.
        problems: when given, a ``.bits`` file whose header cannot be read, or a store part that cannot be
            read, is described here and skipped; when None, it raises.

    Raises:
        FileNotFoundError: no such directory, or no readable direction in it (a folder of
            runs is named as such, with its runs).
        DirectionFormatError: a ``.bits`` file is not a direction file, or a store part not readable (only when
            ``problems`` is None).
    """
    if not is_dir(run_dir):
        raise FileNotFoundError(f"{run_dir}: {'not a directory' if os.path.lexists(run_dir) else 'no such directory'}")
    store_run, store_ranks = run_dir, None
    if is_dir(run_dir / PROBE_DIR):
        rank_dirs = [(_rank_number(run_dir.name), run_dir)]
    else:
        rank_dirs = [(_rank_number(p.name), p) for p in rank_dirs_of(run_dir) if is_dir(p / PROBE_DIR)]
    if not rank_dirs_of(run_dir) and re.fullmatch(r"rank\d+", run_dir.name):  # a rank folder: its run's store
        store_run, store_ranks = run_dir.parent, {_rank_number(run_dir.name)}
    tree: Tree = {}
    for rank, rank_dir in rank_dirs:
        for path in sorted((rank_dir / PROBE_DIR).glob("step*/*.bits")):
            try:
                info = read_direction_header(path)
            except DirectionFormatError as exc:
                if problems is None:
                    raise
                problems.append(f"unreadable direction file, skipped: {exc}")
                continue
            tree.setdefault(rank, {}).setdefault(int(info.header["step"]), {})[info.key] = info
    try:
        stored = scan_directions(store_run, store_ranks, problems)
    except OSError as exc:
        if problems is None:
            raise
        problems.append(f"{store_run / STORE_DIR}: cannot list the store, skipped ({exc.strerror or exc})")
        stored = {}
    for rank, steps in stored.items():
        for step, entries in steps.items():
            known = tree.setdefault(rank, {}).setdefault(step, {})
            for key, entry in entries.items():
                known.setdefault(key, entry)
    if not tree:
        runs = [] if rank_dirs_of(run_dir) else find_runs(run_dir)
        if runs:
            raise FileNotFoundError(runs_hint(run_dir, runs, "grad-compare"))
        raise FileNotFoundError(f"{run_dir}: no grad-probe direction files (rank*/{PROBE_DIR}/step*/*.bits; "
                                f"{STORE_DIR}/{GRAD_DIRECTIONS}/ with sinks: [parquet]; they are written at grad_probe "
                                "level L1 or L2)")
    return tree


def _rank_number(name: str) -> int:
    digits = name.removeprefix("rank")
    return int(digits) if digits.isdigit() else 0


def sign_similarity(bits_a: npt.NDArray[np.uint8], bits_b: npt.NDArray[np.uint8], count: int) -> float:
    """Fraction of equal bits among the first ``count`` of two packed arrays (padding bits are 0)."""
    differing = int(_POPCOUNT[np.bitwise_xor(bits_a, bits_b)].sum())
    return (count - differing) / count if count else float("nan")


def _layout(info: Direction) -> tuple[Any, ...]:
    h = info.header
    return tuple(h["shape"]), int(h["count"]), json_key(h.get("sample"))


def json_key(value: Any) -> Any:
    return tuple(sorted(value.items())) if isinstance(value, dict) else value


def compare(tree_a: Tree, tree_b: Tree, show_progress: bool | None = None) -> Comparison:
    """Similarity rows for everything the two runs share; problems for everything they do not."""
    result = Comparison()
    for rank in sorted(set(tree_a) ^ set(tree_b)):
        result.problems.append(f"rank {rank} only in run {'A' if rank in tree_a else 'B'}")
    pairs = []
    for rank in sorted(set(tree_a) & set(tree_b)):
        steps_a, steps_b = tree_a[rank], tree_b[rank]
        for step in sorted(set(steps_a) ^ set(steps_b)):
            result.problems.append(f"rank {rank}: step {step} only in run {'A' if step in steps_a else 'B'}")
        for step in sorted(set(steps_a) & set(steps_b)):
            pairs.append((rank, step, steps_a[step], steps_b[step]))
    for rank, step, params_a, params_b in progress(pairs, len(pairs), "grad-compare", show_progress, unit="step"):
        for key in sorted(set(params_a) ^ set(params_b)):
            result.problems.append(f"rank {rank} step {step}: parameter {_label(key)} only in run "
                                   f"{'A' if key in params_a else 'B'}")
        step_rows = []
        for key in [k for k in params_a if k in params_b]:
            a, b = params_a[key], params_b[key]
            if _layout(a) != _layout(b):
                differs = [f"{name} {str(a.header.get(name))[:60]} vs {str(b.header.get(name))[:60]}"
                           for name, x, y in zip(("shape", "count", "sample"), _layout(a), _layout(b)) if x != y]
                result.problems.append(f"rank {rank} step {step}: parameter {_label(key)} differs in layout: "
                                       f"{', '.join(differs)} (not compared)")
                continue
            count = int(a.header["count"])
            try:
                similarity = sign_similarity(a.bits(), b.bits(), count)
            except DirectionFormatError as exc:
                result.problems.append(f"rank {rank} step {step}: parameter {_label(key)} not compared: {exc}")
                continue
            step_rows.append({"kind": "param", "rank": rank, "step": step, "vpp_stage": key[0], "name": key[1],
                              "count": count, "similarity": similarity})
        result.rows.extend(step_rows)
    result.rows.extend(_summaries([r for r in result.rows if r["kind"] == "param"]))
    result.rows.sort(key=lambda r: (r["step"], r["kind"] != "param", str(r["rank"]), r["vpp_stage"], r["name"]))
    return result


def _label(key: tuple[int, str]) -> str:
    return key[1] if key[0] == 0 else f"{key[1]} (vpp {key[0]})"


def _summaries(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per step over every rank and parameter: element-weighted and parameter-averaged similarity."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_step.setdefault(row["step"], []).append(row)
    out = []
    for step, items in by_step.items():
        counts = np.array([r["count"] for r in items], dtype=np.float64)
        sims = np.array([r["similarity"] for r in items], dtype=np.float64)
        total = int(counts.sum())
        base = {"rank": "", "step": step, "vpp_stage": "", "name": "", "count": total}
        out.append({**base, "kind": "element_weighted", "similarity": float((sims * counts).sum() / counts.sum())})
        out.append({**base, "kind": "param_averaged", "similarity": float(sims.mean())})
    return out


def write_outputs(result: Comparison, out: Path, plots: bool = True) -> list[Path]:
    """``similarities.csv``, ``problems.txt`` (when there are any) and, with ``plots``, PNG files.

    Returns:
        the files written, in that order.
    """
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "similarities.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=SIMILARITY_COLUMNS)
        writer.writeheader()
        for row in result.rows:
            writer.writerow({**row, "similarity": repr(float(row["similarity"]))})
    written = [out / "similarities.csv"]
    problems = out / "problems.txt"
    if result.problems:
        problems.write_text("\n".join(result.problems) + "\n", encoding="utf-8")
        written.append(problems)
    elif problems.exists():
        problems.unlink()
    if plots:
        written.extend(plot(result, out))
    return written


LABELLED_LINES = 10
"""At most this many parameters get a line and a legend entry of their own in the lines plot."""


def _grid(rows: Sequence[dict[str, Any]]
          ) -> tuple[list[int], list[str], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Steps, parameter labels, and the parameter x step similarity and element-count grids of one rank."""
    steps = sorted({r["step"] for r in rows})
    names = sorted({(r["vpp_stage"], r["name"]) for r in rows})
    name_index = {key: i for i, key in enumerate(names)}
    step_index = {step: i for i, step in enumerate(steps)}
    grid = np.full((len(names), len(steps)), np.nan)
    counts = np.zeros((len(names), len(steps)))
    for r in rows:
        at = name_index[(r["vpp_stage"], r["name"])], step_index[r["step"]]
        grid[at], counts[at] = r["similarity"], r["count"]
    return steps, [_label(k) for k in names], grid, counts


def lines_figure(rows: Sequence[dict[str, Any]], rank: int) -> Any:
    """The lines plot of one rank's ``param`` rows (a matplotlib Figure).

    The :data:`LABELLED_LINES` parameters with the lowest mean similarity (those that differ most)
    get a labelled line each; every other parameter is folded into one median line with its min-max
    band; the rank's element-weighted similarity is the thick black line.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps, labels, grid, counts = _grid(rows)
    means = np.array([np.nanmean(line) if not np.isnan(line).all() else np.inf for line in grid])
    order = np.argsort(means, kind="stable")
    shown, rest = order[:LABELLED_LINES], order[LABELLED_LINES:]
    fig = Figure(figsize=(10, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if len(rest):
        with warnings.catch_warnings():  # a step where none of the others was compared: NaN, quietly
            warnings.simplefilter("ignore", RuntimeWarning)
            low, mid, high = (np.nanmin(grid[rest], axis=0), np.nanmedian(grid[rest], axis=0),
                              np.nanmax(grid[rest], axis=0))
        ax.fill_between(steps, low, high, color="0.85", label=f"other {len(rest)} parameters: min-max")
        ax.plot(steps, mid, color="0.5", linewidth=1.5, label=f"other {len(rest)} parameters: median")
    for i in shown:
        ax.plot(steps, grid[i], marker="o", markersize=3, linewidth=1, label=labels[i])
    with np.errstate(all="ignore"):
        weighted = np.nansum(grid * counts, axis=0) / np.where(np.isnan(grid), 0, counts).sum(axis=0)
    ax.plot(steps, weighted, color="black", linewidth=2.5, label="all parameters: element-weighted")
    title = f"rank {rank}: gradient-sign agreement of run A and run B, {len(labels)} parameters"
    ax.set(xlabel="step", ylabel="fraction of equal gradient signs",
           title=title + (f" ({len(shown)} lowest labelled)" if len(rest) else ""), ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return fig


def heatmap_figure(rows: Sequence[dict[str, Any]], rank: int) -> Any:
    """Parameter x step heatmap of one rank's ``param`` rows with a labelled colour bar (a matplotlib
    Figure; at most ~30 step and ~60 parameter names on the axes)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps, labels, grid, _ = _grid(rows)
    fig = Figure(figsize=(min(0.4 * len(steps), 16) + 4, min(0.25 * len(labels), 16) + 1.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(grid, aspect="auto", vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest")
    x_every, y_every = max(1, -(-len(steps) // 30)), max(1, -(-len(labels) // 60))
    ax.set_xticks(range(0, len(steps), x_every), [str(s) for s in steps[::x_every]], fontsize=7)
    ax.set_yticks(range(0, len(labels), y_every), labels[::y_every], fontsize=7)
    ax.set(xlabel="step", ylabel="parameter", title=f"rank {rank}: fraction of equal gradient signs per parameter")
    fig.colorbar(image, ax=ax, label="fraction of equal gradient signs")
    return fig


def plot(result: Comparison, out: Path) -> list[Path]:
    """Per rank: ``similarity_lines_rank{R}.png`` (:func:`lines_figure`) and ``similarity_heatmap_rank{R}.png``
    (:func:`heatmap_figure`). Returns the written paths."""
    written = []
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for row in result.rows:
        if row["kind"] == "param":
            by_rank.setdefault(row["rank"], []).append(row)
    for rank, rows in sorted(by_rank.items()):
        for kind, figure in (("lines", lines_figure), ("heatmap", heatmap_figure)):
            path = out / f"similarity_{kind}_rank{rank}.png"
            figure(rows, rank).savefig(path, dpi=100, bbox_inches="tight")
            written.append(path)
    return written
