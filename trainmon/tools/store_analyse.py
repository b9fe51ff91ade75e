"""``trainmon analyse`` over a run's store, in SQL (DuckDB, embedded): :func:`analyse_store` and :func:`row_sections`.

Everything goes through the views of :func:`trainmon.tools.store.open_run` (one per family, ``anomalies``), so a
view that maps or expands rows serves this module too. Two kinds of answers:

- **The anomaly events** (``anomalies``): the answer of :func:`trainmon.anomaly.merge.analyse_run` from the same
  events, key for key: the earliest events (DESIGN.md's order: step, micro-step, phase, pipeline position
  ascending in the forward pass and descending in the backward pass, execution order, rank; then the order the
  rank wrote them), the first non-finite event, the first spike, the first event of each step, counts. DuckDB
  reads only the columns a query needs from the Parquet files and keeps only the top K and the per-step firsts;
  the reported events alone are read whole (figures: docs/performance.md).
- **The rows** (the family tables), which the events cannot give (:func:`row_sections`):

  - ``first_nonfinite_row``: the first row whose tensor held a NaN or Inf, over every family and rank, in the
    same execution order; it is there even when no ``nonfinite`` detector ran.
  - ``spread``: per (family, tensor, step, micro-step, VPP stage), the ``norm`` across ranks: min, median,
    max, ``spread = max - min`` and ``relative_spread = spread / |median|`` (``inf`` when the median is 0 and the
    spread is not); the K largest relative spreads (groups of 2 ranks or more).
  - ``deviating_ranks``: per such group of 3 ranks or more, each rank's robust z score,
    ``z = (norm - median) / (1.4826 * MAD)`` with ``MAD = median(|norm - median|)`` (the modified z score of
    Iglewicz and Hoaglin; when the MAD is 0, the mean absolute deviation times 1.2533 stands in for it; the scale
    is at least 1% of ``|median|``, so ranks within a few percent of each other are never outliers; a group whose
    ranks all agree is left out). Per rank: the groups it is in, ``outliers`` (the groups where it is the
    rank farthest from the median with ``|z| >= 3.5``), the mean and largest ``|z|`` and the group of the largest;
    ranks are listed by outliers, then mean ``|z|``. Norms that are not finite are left out of both (the
    non-finite row answers for them).

The ordering and phase ranks come from :mod:`trainmon.anomaly.ordering`, the non-finite rule from
:mod:`trainmon.anomaly.events`; the connection, the quoting, the SQL order and the step filter they share from
:mod:`trainmon.tools.store_sql`.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from trainmon.anomaly.events import NONFINITE_DETECTORS, WRITE_ORDER, encode_float
from trainmon.anomaly.firsts import check_detectors, headline
from trainmon.anomaly.ordering import describe
from trainmon.anomaly.step_ranges import StepRanges
from trainmon.base.inputs import rank_dirs_of
from trainmon.sinks.store_events import EVENTS_FILE, stored_ranges
from trainmon.sinks.store_layout import ANOMALIES, SCALARS, STORE_DIR, table_dir
from trainmon.tools.store import REPLICAS, event_ranks, open_run, views
from trainmon.tools.store_reader import StoreError
from trainmon.tools.store_sql import ORDER_KEY as ORDER_KEY  # also its address before the split
from trainmon.tools.store_sql import StepFilter, identifier, literal
from trainmon.tools.store_sql import connect as connect  # also its address before the split

Z_THRESHOLD = 3.5
"""``|z|`` from which a rank is an outlier of a group (Iglewicz and Hoaglin's cut-off for the modified z score)."""
MIN_RANKS_Z = 3
"""Ranks a group needs for robust z scores (with 2, both are equally far from their median)."""
MIN_RELATIVE_SCALE = 0.01
"""The z scale is at least this fraction of ``|median|``: ranks that agree to within a few percent are no outliers,
however tightly the other ranks agree (with 3 ranks, two close values make a tiny MAD)."""
METRIC = "norm"
"""The metric compared across ranks."""
_MAD_SCALE = 1.4826  # 1 / Phi^-1(3/4): the MAD of a normal sample times this estimates its standard deviation
_MEAN_AD_SCALE = 1.2533  # sqrt(pi / 2): the same for the mean absolute deviation
_NONFINITE = f"(detector IN ({', '.join(repr(d) for d in sorted(NONFINITE_DETECTORS))}) OR NOT isfinite(value))"


def _event(row: tuple[Any, ...], columns: list[str]) -> dict[str, Any]:
    """An event as a line of ``anomalies.jsonl`` reads (its keys in the written order, NaN and Inf as strings)."""
    data = dict(zip(columns, row))
    event = {name: data[name] for name in WRITE_ORDER}
    event["value"], event["baseline"] = encode_float(event["value"]), encode_float(event["baseline"])
    return event


def _events_by_id(con: duckdb.DuckDBPyConnection, ids: list[tuple[int, int]]) -> dict[tuple[int, int], dict[str, Any]]:
    """The full events of ``(rank, seq)`` ids (a second pass that reads the text columns of those events only)."""
    if not ids:
        return {}
    ranks, seqs = zip(*ids)
    con.register("_trainmon_ids", pa.table({"rank": pa.array(ranks, pa.int64()), "seq": pa.array(seqs, pa.int64())}))
    try:
        result = con.execute(f"SELECT * FROM {ANOMALIES} SEMI JOIN _trainmon_ids USING (rank, seq)")
        columns = [d[0] for d in result.description or []]
        return {(row[columns.index("rank")], row[columns.index("seq")]): _event(row, columns)
                for row in result.fetchall()}
    finally:
        con.unregister("_trainmon_ids")


def _event_files(run_dir: Path) -> int:
    """The ranks whose events the run holds: ``rank{R}/anomalies.jsonl`` or stored event files (what the JSON
    reader counts as files)."""
    ranks = {int(p.name[4:]) for p in rank_dirs_of(run_dir) if os.path.lexists(p / EVENTS_FILE)}
    ranks |= {rank for rank in event_ranks(run_dir) if stored_ranges(table_dir(run_dir, ANOMALIES, rank))}
    return len(ranks)


def analyse_store(run_dir: str | os.PathLike[str], top: int = 20, steps: StepRanges | None = None,
                  detectors: Collection[str] | None = None, rows: bool = True) -> dict[str, Any]:
    """:func:`trainmon.anomaly.merge.analyse_run` of a run with a store, in SQL, plus the row sections.

    Args:
        run_dir: ``{output_dir}/{run_name}`` with a ``store/``.
        top: how many earliest events (and spread groups, and ranks) to keep.
        steps: only these steps (None: all).
        detectors: only the events of these detectors (None: all).
        rows: also compute :func:`row_sections` (``first_nonfinite_row``, ``spread``, ``deviating_ranks``).

    Returns:
        The keys of ``analyse_run``'s result (the same values from the same events; ``corrupt`` is empty: lines
        that were not events when the store took them are not kept) and those of :func:`row_sections`.

    Raises:
        StoreError: no store, or a file of it that cannot be read (one line naming it).
        ~trainmon.anomaly.firsts.UnknownDetectorError: a name in ``detectors`` is no detector.
    """
    root = Path(run_dir)
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    with connect() as con:
        open_run(root, connection=con)
        try:
            result = _analyse_events(con, root, top, steps, detectors)
            if rows:
                result.update(row_sections(con, top, steps))
        except duckdb.Error as exc:
            raise StoreError(f"{root / STORE_DIR}: {str(exc).splitlines()[0]}") from None
    return result


def store_rows(run_dir: str | os.PathLike[str], top: int = 20, steps: StepRanges | None = None) -> dict[str, Any]:
    """:func:`row_sections` of a folder with a store (a run, or msprobe's output after ``trainmon convert``).

    Raises:
        StoreError: no store, or a file of it that cannot be read (one line naming it).
    """
    root = Path(run_dir)
    with connect() as con:
        open_run(root, connection=con)
        try:
            return row_sections(con, top, steps)
        except duckdb.Error as exc:
            raise StoreError(f"{root / STORE_DIR}: {str(exc).splitlines()[0]}") from None


def _analyse_events(con: duckdb.DuckDBPyConnection, root: Path, top: int, steps: StepRanges | None,
                    detectors: Collection[str] | None) -> dict[str, Any]:
    present = sorted(str(d) for (d,) in con.execute(f"SELECT DISTINCT detector FROM {ANOMALIES}").fetchall())
    check_detectors(detectors, present)
    where = StepFilter(con, steps).steps
    if detectors is not None:
        where += " AND detector IN (SELECT unnest($detectors))"
    params = {"detectors": sorted(detectors)} if detectors is not None else {}
    selected = f"(SELECT * FROM {ANOMALIES} WHERE {where})"
    by_rank: dict[int, int] = {}
    by_step: dict[int, int] = {}
    by_detector: dict[str, int] = {}
    counts = con.execute(f"SELECT rank, step, detector, count(*) FROM {selected} GROUP BY GROUPING SETS "
                         "((rank), (step), (detector))", params).fetchall()
    for rank, step, detector, count in counts:
        if rank is not None:
            by_rank[rank] = count
        elif step is not None:
            by_step[step] = count
        else:
            by_detector[detector] = count
    key = f"{ORDER_KEY}, seq"
    top_ids = con.execute(f"SELECT rank, seq FROM {selected} ORDER BY {key} LIMIT {int(top)}", params).fetchall()
    first_of = {}
    for nonfinite in (True, False):  # two top-1 sorts: ~4x faster than one arg_min over (key, ...) rows
        found = con.execute(f"SELECT rank, seq FROM {selected} WHERE {'' if nonfinite else 'NOT '}{_NONFINITE} "
                            f"ORDER BY {key} LIMIT 1", params).fetchone()
        if found is not None:
            first_of[nonfinite] = (found[0], found[1])
    by_step_ids = con.execute(f"SELECT step, arg_min(struct_pack(rank, seq), row({key})) FROM {selected} "
                              "GROUP BY step ORDER BY step", params).fetchall()
    step_ids = [(found["rank"], found["seq"]) for _, found in by_step_ids]
    events = _events_by_id(con, sorted({*top_ids, *first_of.values(), *step_ids}))
    ordered = [events[i] for i in top_ids]
    first_nonfinite = events[first_of[True]] if True in first_of else None
    return {
        "run_dir": str(root),
        "files": _event_files(root),
        "events": sum(by_rank.values()),
        "steps": str(steps) if steps is not None else None,
        "detectors": sorted(detectors) if detectors is not None else None,
        "detectors_present": present,
        "first_origin": headline(first_nonfinite, ordered),
        "first_nonfinite": first_nonfinite,
        "first_spike": events[first_of[False]] if False in first_of else None,
        "top": ordered,
        "first_by_step": [events[i] for i in step_ids],
        "counts": {"by_rank": {str(k): v for k, v in sorted(by_rank.items())},
                   "by_step": {str(k): v for k, v in sorted(by_step.items())},
                   "by_detector": dict(sorted(by_detector.items()))},
        "corrupt": [],
        "corrupt_total": 0,
        "source": "store",
    }


def row_families(con: duckdb.DuckDBPyConnection) -> dict[str, list[str]]:
    """The family views of a connection (those with a ``nonfinite`` column) and their columns."""
    found = {}
    for view in views(con):
        if view in (ANOMALIES, SCALARS):
            continue
        columns = [str(name) for name, *_ in con.execute(f"DESCRIBE {identifier(view)}").fetchall()]
        if "nonfinite" in columns:
            found[view] = columns
    return found


def _tables(con: duckdb.DuckDBPyConnection) -> set[str]:
    """The tables and registered frames of a connection (``replicas`` is registered, not a view)."""
    return {str(name) for (name,) in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}


def row_sections(con: duckdb.DuckDBPyConnection, top: int = 20, steps: StepRanges | None = None) -> dict[str, Any]:
    """The answers of the rows (see the module): ``first_nonfinite_row``, ``nonfinite_rows``, ``spread`` and
    ``deviating_ranks``, over the family views of ``con`` (:func:`trainmon.tools.store.open_run`'s)."""
    families = row_families(con)
    where = StepFilter(con, steps).steps
    first, count, ranks = _first_nonfinite_row(con, families, where)
    # A family written once per data-parallel group is the same on every rank of the group by construction: no
    # cross-rank spread to find there (and the view would repeat the writer's rows for every rank).
    once = ({family for (family,) in con.execute(f"SELECT DISTINCT family FROM {REPLICAS}").fetchall()}
            if REPLICAS in views(con) or REPLICAS in _tables(con) else set())
    with_norm = [family for family, columns in families.items() if METRIC in columns and family not in once]
    spread, deviating = _cross_rank(con, with_norm, where, top)
    return {"first_nonfinite_row": first, "nonfinite_rows": {"rows": count, "ranks": ranks},
            "spread": spread, "deviating_ranks": deviating}


_KEY_COLUMNS = 'rank, step, micro_step, phase, pp_stage, vpp_stage, "order", name'
_NOT_METRICS = frozenset({"rank", "step", "micro_step", "phase", "pp_stage", "vpp_stage", "order", "name", "nonfinite"})


def _first_nonfinite_row(con: duckdb.DuckDBPyConnection, families: dict[str, list[str]],
                         where: str) -> tuple[dict[str, Any] | None, int, int]:
    if not families:
        return None, 0, 0
    union = " UNION ALL ".join(f"SELECT {literal(family)} AS family, {_KEY_COLUMNS} FROM {identifier(family)} "
                               f"WHERE nonfinite AND {where}" for family in families)
    found = con.execute(f"WITH nonfinite AS ({union}) SELECT (SELECT count(*) FROM nonfinite), "
                        "(SELECT count(DISTINCT rank) FROM nonfinite), * FROM nonfinite "
                        f"ORDER BY {ORDER_KEY}, family, name LIMIT 1")
    columns = [d[0] for d in found.description or []]
    row = found.fetchone()
    if row is None:
        return None, 0, 0
    data = dict(zip(columns[2:], row[2:]))
    family = data["family"]
    metrics = [c for c in families[family] if c not in _NOT_METRICS]
    selected = ", ".join(identifier(m) for m in metrics)
    values = con.execute(f"SELECT {selected} FROM {identifier(family)} WHERE rank = $rank AND step = $step AND "
                         "micro_step = $micro_step AND vpp_stage = $vpp_stage AND \"order\" = $order AND name = $name "
                         "AND phase = $phase AND nonfinite LIMIT 1",
                         {k: data[k] for k in ("rank", "step", "micro_step", "vpp_stage", "order", "name", "phase")}
                         ).fetchone() if metrics else ()
    first = {"family": family, "name": data["name"], "rank": data["rank"], "step": data["step"],
             "micro_step": data["micro_step"], "phase": data["phase"], "pp_stage": data["pp_stage"],
             "vpp_stage": data["vpp_stage"], "order": data["order"],
             "values": {m: _number(v) for m, v in zip(metrics, values or ())},
             "message": f"step {data['step']}, micro-step {data['micro_step']}, rank {data['rank']}: "
                        f"{describe(family, data['name'], data['phase'])}"}
    return first, int(row[0]), int(row[1])


def _number(value: Any) -> float | str | None:
    """A float for JSON: NaN and Inf as strings, a missing value as None."""
    return None if value is None else encode_float(float(value))


def _cross_rank(con: duckdb.DuckDBPyConnection, families: list[str], where: str,
                top: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The spread groups and the deviating ranks (see the module), one family at a time (bounded memory)."""
    con.execute("CREATE OR REPLACE TEMP TABLE _trainmon_groups (family VARCHAR, gid BIGINT, name VARCHAR, step BIGINT, "
                "micro_step INTEGER, vpp_stage INTEGER, ranks BIGINT, lo DOUBLE, med DOUBLE, hi DOUBLE, "
                "lo_rank BIGINT, hi_rank BIGINT, scale DOUBLE, far_rank BIGINT, far_z DOUBLE)")
    con.execute("CREATE OR REPLACE TEMP TABLE _trainmon_rank_z (rank BIGINT, groups BIGINT, sum_abs_z DOUBLE, "
                "max_abs_z DOUBLE, family VARCHAR, gid BIGINT, x DOUBLE, z DOUBLE)")
    for family in families:
        rows = (f"SELECT rank, name, step, micro_step, vpp_stage, {METRIC} AS x FROM {identifier(family)} "
                f"WHERE isfinite({METRIC}) AND {where}")
        # Three passes, each an aggregation that DuckDB streams: per group (numbered: the later passes group by the
        # number, not by name and step) the median and extremes; then, the rows joined with them, the absolute
        # deviations' median (the MAD) and mean, and the lowest rank at the minimum, at the maximum and farthest from
        # the median (ties go to the lowest rank); then each rank's z scores. No list functions (DuckDB's
        # list_median costs ~10x its median aggregate), no arg_min over (value, rank) pairs (~3x a min).
        con.execute(f"""
            CREATE OR REPLACE TEMP TABLE _trainmon_family AS
            SELECT row_number() OVER () AS gid, * FROM (
                SELECT name, step, micro_step, vpp_stage, count(*) AS ranks, min(x) AS lo, median(x) AS med,
                       max(x) AS hi
                FROM ({rows}) GROUP BY name, step, micro_step, vpp_stage HAVING count(*) >= 2)""")
        con.execute(f"""
            INSERT INTO _trainmon_groups
            WITH deviations AS (
                SELECT gid, median(d) AS mad, avg(d) AS mean_ad, min(rank) FILTER (WHERE x = lo) AS lo_rank,
                       min(rank) FILTER (WHERE x = hi) AS hi_rank, min(rank) FILTER (WHERE d = far) AS far_rank
                FROM (SELECT r.rank, r.x, g.gid, g.lo, g.hi, abs(r.x - g.med) AS d,
                             greatest(g.hi - g.med, g.med - g.lo) AS far
                      FROM ({rows}) r JOIN _trainmon_family g USING (name, step, micro_step, vpp_stage))
                GROUP BY gid),
            robust AS (
                SELECT *, CASE WHEN ranks < {MIN_RANKS_Z} THEN NULL WHEN mad > 0 THEN {_MAD_SCALE} * mad
                               WHEN mean_ad > 0 THEN {_MEAN_AD_SCALE} * mean_ad END AS robust,
                       greatest(hi - med, med - lo) AS far
                FROM _trainmon_family JOIN deviations USING (gid))
            SELECT {literal(family)}, gid, name, step, micro_step, vpp_stage, ranks, lo, med, hi, lo_rank, hi_rank,
                   CASE WHEN robust IS NOT NULL THEN greatest(robust, {MIN_RELATIVE_SCALE} * abs(med)) END AS scale,
                   far_rank, far / scale
            FROM robust""")
        con.execute(f"""
            INSERT INTO _trainmon_rank_z
            SELECT rank, groups, sum_abs_z, max_abs_z, {literal(family)}, worst.gid, worst.x, worst.z FROM (
                SELECT rank, count(*) AS groups, sum(abs(z)) AS sum_abs_z, max(abs(z)) AS max_abs_z,
                       arg_max(struct_pack(gid, x, z), row(abs(z), -step)) AS worst
                FROM (SELECT r.rank, r.x, r.step, g.gid, (r.x - g.med) / g.scale AS z
                      FROM ({rows}) r JOIN (SELECT * FROM _trainmon_groups WHERE family = {literal(family)}
                                            AND scale IS NOT NULL) g USING (name, step, micro_step, vpp_stage))
                GROUP BY rank)""")
    spread = con.execute(f"""
        SELECT family, name, step, micro_step, vpp_stage, ranks, lo, med, hi, hi - lo AS spread,
               CASE WHEN med <> 0 THEN (hi - lo) / abs(med) WHEN hi > lo THEN 'inf'::DOUBLE ELSE 0 END AS relative,
               lo_rank, hi_rank
        FROM _trainmon_groups ORDER BY relative DESC, spread DESC, step, family, name, micro_step, vpp_stage
        LIMIT {int(top)}""").fetchall()
    groups = [{"family": f, "name": n, "step": s, "micro_step": m, "vpp_stage": v, "ranks": r, "min": _number(lo),
               "median": _number(med), "max": _number(hi), "spread": _number(sp), "relative_spread": _number(rel),
               "min_rank": lr, "max_rank": hr}
              for f, n, s, m, v, r, lo, med, hi, sp, rel, lr, hr in spread]
    scored, outlying = con.execute(f"SELECT count(*), count(*) FILTER (WHERE far_z >= {Z_THRESHOLD}) "
                                   "FROM _trainmon_groups WHERE scale IS NOT NULL").fetchone() or (0, 0)
    ranked = con.execute(f"""
        WITH per_rank AS (
            SELECT rank, sum(groups) AS groups, sum(sum_abs_z) / sum(groups) AS mean_abs_z,
                   max(max_abs_z) AS max_abs_z,
                   arg_max(struct_pack(family, name, step, micro_step, vpp_stage, {METRIC} := x, median := med, z),
                           row(max_abs_z, -step)) AS worst
            FROM _trainmon_rank_z JOIN _trainmon_groups USING (family, gid) GROUP BY rank),
        outliers AS (
            SELECT far_rank AS rank, count(*) AS outliers FROM _trainmon_groups
            WHERE scale IS NOT NULL AND far_z >= {Z_THRESHOLD} GROUP BY far_rank)
        SELECT rank, coalesce(outliers, 0) AS outliers, groups, mean_abs_z, max_abs_z, worst
        FROM per_rank LEFT JOIN outliers USING (rank)
        ORDER BY outliers DESC, mean_abs_z DESC, rank LIMIT {int(top)}""").fetchall()
    deviating = {
        "metric": METRIC, "threshold": Z_THRESHOLD, "min_ranks": MIN_RANKS_Z, "groups": int(scored),
        "groups_with_outlier": int(outlying),
        "ranks": [{"rank": rank, "outliers": outliers, "groups": count, "mean_abs_z": _number(mean),
                   "max_abs_z": _number(largest),
                   "worst": {k: (_number(v) if k in (METRIC, "median", "z") else v) for k, v in worst.items()}}
                  for rank, outliers, count, mean, largest, worst in ranked],
    }
    return groups, deviating


__all__ = ["MIN_RANKS_Z", "MIN_RELATIVE_SCALE", "Z_THRESHOLD", "analyse_store", "row_families", "row_sections",
           "store_rows"]
