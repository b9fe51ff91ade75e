"""What ``trainmon csv2tb`` converts (framework-free): a run's rank folders and the sources of each rank.

:func:`rank_dirs` finds the ``rank*`` folders of a run (or msprobe's rank folders), :func:`sources_of` the CSV
files of each and the families of the run's store that have no CSV file (:mod:`trainmon.tools.store_reader`),
:func:`layouts_of` the layout a source is in, and :func:`complete_steps` joins the rows of a step that two batches
of a store part split. :mod:`trainmon.tools.csv2tb` writes their event files.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from trainmon.base.inputs import find_runs, is_dir, rank_dirs_of, runs_hint
from trainmon.tools.msprobe_output import rank_folders
from trainmon.tools.readers import read_scalars_noting_layout
from trainmon.tools.store_reader import STORE_LAYOUT, Source, StoreFamily, store_families, with_store


def has_csv(folder: Path) -> bool:
    """Whether ``folder`` holds a CSV file (False when it cannot be listed)."""
    try:
        return any(folder.glob("*.csv"))
    except (OSError, ValueError):
        return False


def rank_dirs(run_dir: Path) -> list[Path]:
    """The ``rank*`` directories of a run (or the directory itself if it is one); none for a run that has only
    its ``store/`` (:func:`sources_of` adds the store's ranks).

    Raises:
        FileNotFoundError: not a directory, or one with neither ``rank*/`` folders nor CSV files nor a store
            (a folder of runs is named as such, with its runs).
        StoreError: the run's store cannot be listed.
    """
    if not is_dir(run_dir):
        raise FileNotFoundError(f"{run_dir}: {'not a directory' if os.path.lexists(run_dir) else 'no such directory'}")
    ranks = rank_dirs_of(run_dir)
    if not ranks and has_csv(run_dir):
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


def layouts_of(source: Source) -> set[str]:
    """The layout of a source, as :func:`~trainmon.tools.store_reader.source_scalars` notes it (a CSV file's from its
    header)."""
    if isinstance(source, StoreFamily):
        return {STORE_LAYOUT}
    layouts: set[str] = set()
    rows = read_scalars_noting_layout(source, layouts)
    try:
        next(rows, None)
    finally:
        rows.close()
    return layouts


def complete_steps(tables: Iterator[Any]) -> Iterator[Any]:
    """``tables`` (a source's, in the order written) as tables that each end with a whole step: the rows of a step
    split between two batches of a store part are joined (row ids made common to the tables given)."""
    from trainmon.tools.readers import Table

    keys: dict[tuple[int, str], int] = {}
    held: Any = None
    for table in tables:
        if not len(table.steps):
            continue
        lookup = np.fromiter((keys.setdefault(key, len(keys)) for key in table.keys), np.int64, len(table.keys))
        rows = lookup[table.rows]
        if held is not None and held.metrics == table.metrics:
            rows = np.concatenate((held.rows, rows))
            steps, micro = np.concatenate((held.steps, table.steps)), np.concatenate((held.micro_steps,
                                                                                     table.micro_steps))
            values = np.concatenate((held.values, table.values))
        else:
            if held is not None:
                yield held
            steps, micro, values = table.steps, table.micro_steps, table.values
        last = len(steps) - int(np.argmax(steps[::-1] != steps[-1])) if (steps != steps[-1]).any() else 0
        names = list(keys)
        if last:
            yield Table(table.family, table.metrics, names, rows[:last], steps[:last], micro[:last], values[:last])
        held = Table(table.family, table.metrics, names, rows[last:], steps[last:], micro[last:], values[last:])
    if held is not None:
        yield held


def sources_of(run_dir: Path) -> dict[Path, list[Source]]:
    """``rank folder -> CSV files`` of a run (:func:`rank_dirs`), with the families of its store that have no CSV
    file (a rank only in the store gets its ``rank{R}`` path, whether the folder exists or not)."""
    ranks = rank_dirs(run_dir)
    sources: dict[Path, list[Source]] = {rank_dir: [*sorted(rank_dir.glob("*.csv"))] for rank_dir in ranks}
    numbered = {int(p.name[4:]): p for p in ranks if p.parent == run_dir and p.name[4:].isdigit()}
    for rank, found in with_store(run_dir, {n: list(sources[p]) for n, p in numbered.items()}).items():
        sources[numbered.get(rank, run_dir / f"rank{rank}")] = found
    return sources


__all__ = ["complete_steps", "has_csv", "layouts_of", "rank_dirs", "sources_of"]
