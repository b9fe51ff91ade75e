"""See it coming: how many steps before a real training instability each detector warns, at what false-alarm cost.

    python benchmarks/precursors.py [--quick] [--workers 2] [--markdown] [--json-dir DIR] [--replace]
                                    [--store-dir DIR] [--monitor-config JSON] [--window 100] [--budget 1.0]
                                    [--first-seed 1000]
    python benchmarks/precursors.py --from-json benchmarks/data/precursors [--markdown] [--compact] [--window N]

Trains small GPTs on the CPU with trainmon attached (``benchmarks/precursor_runs.py``: healthy runs and four faults
that make the training itself unstable: a learning-rate ramp, attention logit growth at a high learning rate
without QK normalisation, a repeated-text batch, an epsilon-underflow regime), then runs every detector offline
over the run's store (``benchmarks/precursor_rules.py``): trainmon's default detectors (the anomaly engine
replayed, and each alone over a grid of thresholds) and the peers' rules, on the series each is defined on (the
loss, the global gradient norm) and on every per-layer series the store holds (each ``family/column`` of the
store's row families, read generically: a family another collector adds is evaluated when present; per layer,
an alarm is any layer's). ``benchmarks/leadtime.py`` defines the loss event, the lead time and the false alarms.

Each run's results (its losses, its event, the alarm steps of every detector at every threshold of its grid) are
written to ``--json-dir`` as ``{run}.json``; ``--from-json`` recomputes the tables from them without training.

Output: per detector and fault, the median lead time (steps) and the recall at the detector's defaults and at the
most sensitive threshold of its grid that keeps it within ``--budget`` false alarms per 10,000 healthy steps.
``--quick`` (4 short healthy runs, one run per fault) is for trying it out; its false-alarm rates mean little.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import precursor_rules as rules  # noqa: E402
from benchmarks.leadtime import (  # noqa: E402
    FA_BUDGET,
    FAULTS,
    LEAD_WINDOW,
    RunAlarms,
    Summary,
    from_ranges,
    loss_event,
    summarise,
    to_ranges,
    tune,
)
from trainmon.anomaly.detectors import ATTN_GROWTH_DEFAULT, EPS_LEVEL_DEFAULT  # noqa: E402

JSON_DIR = ROOT / "benchmarks" / "data" / "precursors"
META_COLUMNS = frozenset({"step", "micro_step", "vpp_stage", "pp_stage", "order", "phase", "name", "nonfinite", "rank"})
NON_FAMILY_VIEWS = frozenset({"scalars", "anomalies", "replicas"})
NO_EVENT_HORIZON = 200
"""A fault run without a loss event keeps its alarms this many steps after the onset (up to the event otherwise)."""
HEALTHY_RANGES = 20
"""A run's false alarms are kept as steps (runs of steps) when they form at most this many runs; else only counted."""
Rule = Callable[[rules.Array, Sequence[float], int], rules.Alarms]
"""``(values (steps, columns), thresholds, planned steps) -> alarms (thresholds, steps, columns)``."""


@dataclass(frozen=True)
class DetectorDef:
    """A rule on a series at a grid of thresholds (most sensitive first); ``default`` is the rule's own."""

    name: str
    series: str  # loss, grad_norm, loss+grad_norm, or family/column (per layer)
    rule: str
    thresholds: tuple[float, ...]
    default: float


SIGMAS = (3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 15.0, 25.0, 50.0, 100.0)
ZCLIP_Z = (2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 12.0, 20.0, 50.0, 100.0)
FACTORS = (1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 100.0)
RTOLS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0, 256.0)
TURBULENCE = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0, 256.0)
TRAINMON_Z = (3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 14.0, 20.0)
TRAINMON_GRAD_Z = (3.0, 4.0, 5.0, 7.0, 10.0, 14.0, 20.0)
TRAINMON_LAYER_Z = (4.5, 6.0, 9.0, 14.0, 20.0, 30.0)
"""The per-layer log rule's threshold z, its range factor scaled with it (``precursor_rules.trainmon_log``)."""

RULES: dict[str, Rule] = {
    "trainmon_loss_spike": lambda v, th, n: rules.trainmon_scalar(v, th, rules.LOSS_SPIKE_SPEC, "loss"),
    "trainmon_grad_norm": lambda v, th, n: rules.trainmon_scalar(v, th, rules.GRAD_NORM_SPEC, "grad_norm"),
    "trainmon_layer": lambda v, th, n: rules.trainmon_log(v, th, scale_range=True),
    "skip_step": lambda v, th, n: rules.skip_step(v, th),
    "zclip": lambda v, th, n: rules.zclip(v, th),
    "megatron": lambda v, th, n: rules.megatron(v, th),
    "foundry": lambda v, th, n: rules.foundry(v, th, total_steps=n),
    "lightning": lambda v, th, n: rules.lightning(v, th),
    "turbulence_ema": lambda v, th, n: rules.turbulence(v, th, "ema"),
    "turbulence_121": lambda v, th, n: rules.turbulence(v, th, "1.2.1"),
    "trainmon_growth": lambda v, th, n: rules.trainmon_field(v, th, dict(ATTN_GROWTH_DEFAULT), "factor"),
    "trainmon_level": lambda v, th, n: rules.trainmon_field(v, th, dict(EPS_LEVEL_DEFAULT), "threshold"),
}

SCALAR_DETECTORS: tuple[DetectorDef, ...] = (
    DetectorDef("trainmon loss_spike", "loss", "trainmon_loss_spike", TRAINMON_Z, 6.0),
    DetectorDef("trainmon grad-norm watch", "grad_norm", "trainmon_grad_norm", TRAINMON_GRAD_Z, 7.0),
    DetectorDef("OLMo-core SkipStep 6 sigma", "loss+grad_norm", "skip_step", SIGMAS, 6.0),
    DetectorDef("ZClip z 2.5", "grad_norm", "zclip", ZCLIP_Z, 2.5),
    DetectorDef("Megatron 10x + NaN/Inf", "loss", "megatron", FACTORS, 10.0),
    DetectorDef("Megatron 10x", "grad_norm", "megatron", FACTORS, 10.0),
    DetectorDef("llm-foundry KillLossSpike", "loss", "foundry", (1.2, 1.5, 2.0, 3.0, 5.0, 10.0), 2.0),
    DetectorDef("Lightning SpikeDetection + finite grad norm", "loss+grad_norm", "lightning", RTOLS, 2.0),
    DetectorDef("msprobe 26.2 Turbulence", "loss", "turbulence_ema", TURBULENCE, 0.5),
    DetectorDef("msprobe 26.2 Turbulence", "grad_norm", "turbulence_ema", TURBULENCE, 0.5),
    DetectorDef("msprobe 1.2.1 Turbulence", "loss", "turbulence_121", TURBULENCE, 0.5),
)
LAYER_RULES: tuple[tuple[str, str, tuple[float, ...], float], ...] = (
    ("trainmon spike log persist 3", "trainmon_layer", TRAINMON_LAYER_Z, 6.0),
    ("6 sigma (SkipStep)", "skip_step", SIGMAS, 6.0),
    ("ZClip z 2.5", "zclip", ZCLIP_Z, 2.5),
    ("Megatron 10x", "megatron", FACTORS, 10.0),
    ("Lightning SpikeDetection", "lightning", RTOLS, 2.0),
    ("msprobe 26.2 Turbulence", "turbulence_ema", TURBULENCE, 0.5),
)
"""Rules applied to every per-layer series (``family/column``) of the store."""
FAMILY_DETECTORS: tuple[DetectorDef, ...] = (
    DetectorDef(f"trainmon growth (largest head, window {ATTN_GROWTH_DEFAULT['window']}, "
                f"min {ATTN_GROWTH_DEFAULT['min_value']:g})", "attn/max_logit", "trainmon_growth",
                tuple(sorted({1.5, 1.7, 2.0, 3.0, 4.0, 6.0, 10.0, float(ATTN_GROWTH_DEFAULT["factor"])})),
                float(ATTN_GROWTH_DEFAULT["factor"])),
    DetectorDef("trainmon level (persist 5)", "precursors/eps_underflow", "trainmon_level",
                (0.1, 0.3, 0.5, 0.7, 0.9, 0.99), 0.9),
)
"""trainmon's rules of the optional families' defaults on their series, on a grid of their ``factor`` and
``threshold`` (evaluated when the series is in the store)."""
ENGINE = "trainmon defaults (engine replay)"


def key(detector: DetectorDef) -> str:
    return f"{detector.name} @ {detector.series}"


def theta_key(value: float) -> str:
    return f"{value:g}"


# ------------------------------------------------------------------------------------------- reading a run
def read_store(run_dir: Path) -> tuple[dict[str, np.ndarray], dict[str, tuple[np.ndarray, list[str], np.ndarray]],
                                        list[int]]:
    """The run's scalars (by name, indexed by step), its per-layer series (``family/column`` -> steps, layer
    names, values ``(len(steps), layers)``) and the steps of the anomaly events written online."""
    from trainmon.tools.store import open_run

    con = open_run(run_dir)
    try:
        scalars: dict[str, np.ndarray] = {}
        table = con.sql("SELECT step, name, value FROM scalars WHERE rank = 0").fetchnumpy()
        last = int(table["step"].max()) if len(table["step"]) else -1
        for name in sorted(set(table["name"].tolist())):
            mask = table["name"] == name
            series = np.full(last + 1, np.nan)
            series[table["step"][mask]] = table["value"][mask]
            scalars[str(name)] = series
        layered: dict[str, tuple[np.ndarray, list[str], np.ndarray]] = {}
        views = [str(v) for (v,) in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()]
        for family in sorted(set(views) - NON_FAMILY_VIEWS):
            columns = [(str(c), str(t)) for c, t, *_ in con.execute(f'DESCRIBE "{family}"').fetchall()]
            numeric = [c for c, t in columns if c not in META_COLUMNS and t in ("DOUBLE", "FLOAT", "REAL")]
            if not numeric:
                continue
            selected = ", ".join(f'"{c}"' for c in numeric)
            rows = con.sql(f'SELECT step, name, {selected} FROM "{family}" WHERE rank = 0 AND micro_step = 0 '
                           f"ORDER BY step, name").fetchnumpy()
            steps, step_index = np.unique(rows["step"], return_inverse=True)
            names, name_index = np.unique(rows["name"], return_inverse=True)
            for column in numeric:
                values = np.full((len(steps), len(names)), np.nan)
                values[step_index, name_index] = np.asarray(rows[column], dtype=np.float64)
                layered[f"{family}/{column}"] = (steps.astype(np.int64), [str(n) for n in names], values)
        online = sorted({int(s) for (s,) in con.execute("SELECT step FROM anomalies WHERE rank = 0").fetchall()})
    finally:
        con.close()
    return scalars, layered, online


SERIES_TYPES = frozenset({"spike", "growth", "level"})
"""trainmon's detector types that watch chosen series: their events are labelled by type and series."""


def spec_label(spec: dict[str, Any]) -> str:
    """A default detector's label in the tables: its type, and for a detector of chosen series the first series'
    family or scalar, and ``down`` for a downward rule (``spike grad_norm``, ``spike grad_norm down``,
    ``spike grad_reduced``, ``growth attn``, ``level precursors``).

    Example:
        >>> spec_label({"type": "spike", "series": ["grad_reduced/*/norm"]}), spec_label({"type": "loss_spike"})
        ('spike grad_reduced', 'loss_spike')
    """
    kind = str(spec["type"])
    if kind not in SERIES_TYPES:
        return kind
    down = " down" if spec.get("direction") == "down" else ""
    return f"{kind} {str(spec.get('series', ['loss'])[0]).split('/')[0]}{down}"


def replay_engine(run_dir: Path, scalars: dict[str, np.ndarray]) -> dict[str, list[int]]:
    """trainmon's anomaly engine with its default detectors over the stored rows and scalars, step by step (what
    ran online): alarm steps of all of them (``all``) and of each (:func:`spec_label`: ``nonfinite``,
    ``loss_spike``, ``spike grad_norm``, ``spike grad_reduced``, ...)."""
    from trainmon.anomaly.engine import AnomalyEngine
    from trainmon.base.records import FAMILIES, Row, RowKey, StepRecord
    from trainmon.config import AnomalyConfig
    from trainmon.tools.store import open_run

    engine = AnomalyEngine(AnomalyConfig(actions=[]), rank=0, rank_dir=None)
    con = open_run(run_dir)
    rows_by_step: dict[int, list[Row]] = {}
    try:
        views = {str(v) for (v,) in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
        for family in sorted(views & set(FAMILIES)):
            columns = [str(c) for c, *_ in con.execute(f'DESCRIBE "{family}"').fetchall()]
            metrics = [c for c in columns if c not in META_COLUMNS]
            selected = ", ".join(f'"{c}"' for c in metrics)
            query = (f'SELECT step, name, micro_step, vpp_stage, "order", nonfinite, {selected} FROM "{family}" '
                     f'WHERE rank = 0 ORDER BY step, "order"')
            for step, name, micro, vpp, order, nonfinite, *stats in con.execute(query).fetchall():
                rows_by_step.setdefault(int(step), []).append(Row(
                    RowKey(family, str(name), int(micro), int(vpp), int(order)), int(step),
                    {m: float(v) for m, v in zip(metrics, stats) if v is not None}, bool(nonfinite)))
    finally:
        con.close()
    out: dict[str, list[int]] = {"all": [], **{spec_label(spec): [] for spec in engine.specs}}
    for step in range(len(scalars.get("loss", []))):
        # a scalar absent from a step is NaN in the array (a NaN loss or grad norm stays: it is a value)
        values = {name: float(series[step]) for name, series in scalars.items()
                  if name in ("loss", "grad_norm") or not np.isnan(series[step])}
        rows = sorted(rows_by_step.get(step, []), key=lambda row: row.key.order)
        events = engine.process(StepRecord(step=step, rank=0, rows=rows, scalars=values))
        if events:
            out["all"].append(step)
        for event in events:
            where = event.name if event.family == "scalars" else event.family
            label = event.detector if event.detector not in SERIES_TYPES else f"{event.detector} {where}"
            if event.detector == "spike" and event.value < event.baseline:
                label += " down"  # the grad-norm drop watch (spike rules of the defaults look one way each)
            if label in out and (not out[label] or out[label][-1] != step):
                out[label].append(step)
    engine.close()
    return out


# ------------------------------------------------------------------------------------------- one run
def detectors_for(layered: dict[str, Any]) -> list[DetectorDef]:
    """The scalar detectors and every layer rule on every per-layer series present."""
    out = list(SCALAR_DETECTORS) + [d for d in FAMILY_DETECTORS if d.series in layered]
    for series in sorted(layered):
        out += [DetectorDef(name, series, rule, grid, default) for name, rule, grid, default in LAYER_RULES]
    return out


def alarm_steps(detector: DetectorDef, scalars: dict[str, np.ndarray],
                layered: dict[str, tuple[np.ndarray, list[str], np.ndarray]], planned: int) -> np.ndarray:
    """Alarms of one detector at every threshold of its grid: ``(thresholds, steps)`` over the run's steps."""
    steps = len(scalars["loss"])
    rule = RULES[detector.rule]
    if detector.series in ("loss", "grad_norm"):
        return rules.any_column(rule(scalars[detector.series][:, None], detector.thresholds, planned))
    if detector.series == "loss+grad_norm":
        loss = rules.any_column(rule(scalars["loss"][:, None], detector.thresholds, planned))
        grad = scalars.get("grad_norm", np.full(steps, np.nan))
        if detector.rule == "lightning":  # Fabric's clip_gradients(error_if_nonfinite=True): a non-finite norm
            return np.asarray(loss | ~np.isfinite(grad)[None], dtype=bool)
        return np.asarray(loss | rules.any_column(rule(grad[:, None], detector.thresholds, planned)), dtype=bool)
    at, _, values = layered[detector.series]
    out = np.zeros((len(detector.thresholds), steps), dtype=bool)
    fired = rules.any_column(rule(values, detector.thresholds, planned))
    inside = at < steps
    out[:, at[inside]] = fired[:, inside]
    return out


def fault_levels(at: np.ndarray, values: np.ndarray, onset: int, event: int | None) -> dict[str, float | None]:
    """How a series moved in a fault run: the largest and smallest layer's value, as the median over the 100 steps
    before the onset and at the event (the last step without one)."""
    def stat(rows: np.ndarray, reduce: Any) -> float | None:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            value = float(np.nanmedian(reduce(rows, axis=1))) if len(rows) else math.nan
        return float(f"{value:.4g}") if math.isfinite(value) else None

    before = values[(at >= onset - 100) & (at < onset)]
    last = event if event is not None else int(at[-1]) if len(at) else -1
    now = values[at == last]
    return {"max_before": stat(before, np.nanmax), "max_at_event": stat(now, np.nanmax),
            "min_before": stat(before, np.nanmin), "min_at_event": stat(now, np.nanmin)}


class IncompleteStore(RuntimeError):
    """A run's store lacks steps (its outputs dropped records): its series would have holes."""


def evaluate(spec: dict[str, Any], run_dir: Path, trained: Sequence[float] | None = None) -> dict[str, Any]:
    """Every detector over one run's store: the run's JSON record.

    Raises:
        IncompleteStore: the store's losses are not the ``trained`` ones (a step is missing).
    """
    scalars, layered, online = read_store(run_dir)
    losses = scalars["loss"]
    if trained is not None and not np.array_equal(losses, np.asarray(trained, dtype=np.float64), equal_nan=True):
        raise IncompleteStore(f"{run_dir}: the store holds {int(np.isfinite(losses).sum())} of {len(trained)} "
                              "losses as trained")
    from trainmon.base.records import FAMILIES

    short = [name for name, (at, _, _) in layered.items() if name.split("/")[0] in FAMILIES and len(at) != len(losses)]
    if short:
        raise IncompleteStore(f"{run_dir}: {', '.join(short)} lack steps")
    onset = spec["onset"] if spec["kind"] != "healthy" else None
    event = loss_event(losses.tolist())
    split = onset if onset is not None else len(losses)

    def record(fired: np.ndarray) -> dict[str, Any]:
        steps = np.nonzero(fired)[0]
        healthy, after = steps[steps < split], steps[steps >= split]
        end = event if event is not None else split + NO_EVENT_HORIZON
        out: dict[str, Any] = {"healthy_alarms": len(healthy), "alarms": to_ranges(int(s) for s in after if s <= end)}
        ranges = to_ranges(int(s) for s in healthy)
        if len(ranges) <= HEALTHY_RANGES:  # where the false alarms came from, when they are few
            out["healthy_alarm_steps"] = ranges
        return out

    engine = replay_engine(run_dir, scalars)
    results: dict[str, Any] = {}
    for label, steps in engine.items():
        fired = np.zeros(len(losses), dtype=bool)
        fired[steps] = True
        name = ENGINE if label == "all" else f"trainmon default {label}"
        results[name] = {"series": "engine", "default": "default", "thresholds": {"default": record(fired)}}
    for detector in detectors_for(layered):
        fired = alarm_steps(detector, scalars, layered, spec["steps"])
        results[key(detector)] = {"series": detector.series, "default": theta_key(detector.default),
                                  "thresholds": {theta_key(t): record(f) for t, f in zip(detector.thresholds, fired)}}
    series: dict[str, dict[str, Any]] = {}
    for name, (at, names, values) in layered.items():
        series[name] = {"layers": len(names), "steps": len(at)}
        if onset is not None:
            series[name].update(fault_levels(at, values, onset, event))
    for name in ("loss", "grad_norm"):
        if name in scalars and onset is not None:
            series[name] = fault_levels(np.arange(len(losses)), scalars[name][:, None], onset, event)
    return {
        "spec": spec, "steps": len(losses), "onset": onset, "event": event,
        "losses": [float(f"{v:.5g}") if math.isfinite(v) else str(v) for v in losses.tolist()],
        "series": series,
        "online_alarm_steps": to_ranges(online), "replay_matches_online": to_ranges(online) == to_ranges(engine["all"]),
        "detectors": results,
    }


def reevaluate_one(json_path: str, store_root: str) -> str:
    """Evaluate a kept store again with the installed trainmon (its detectors, its defaults) and rewrite the run's
    JSON in place (in a worker process); the training, its losses and the online events are the store's."""
    path = Path(json_path)
    old = json.loads(path.read_text())
    start = time.perf_counter()
    result = evaluate(old["spec"], Path(store_root) / old["spec"]["name"])
    result["seconds"] = {**old.get("seconds", {}), "evaluate": round(time.perf_counter() - start, 1)}
    path.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    return f"{old['spec']['name']}: evaluated again in {result['seconds']['evaluate']:.0f} s"


def run_one(spec_dict: dict[str, Any], store_root: str, json_dir: str, extra: dict[str, Any] | None) -> str:
    """Train one run, evaluate it and write ``{json_dir}/{name}.json`` (in a worker process)."""
    from benchmarks.precursor_runs import RunSpec, train

    spec = RunSpec(**spec_dict)
    start = time.perf_counter()
    run_dir, losses = train(spec, Path(store_root), extra)
    trained = time.perf_counter() - start
    result = evaluate(spec.to_dict(), run_dir, losses)
    result["seconds"] = {"train": round(trained, 1), "evaluate": round(time.perf_counter() - start - trained, 1)}
    path = Path(json_dir) / f"{spec.name}.json"
    path.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    return (f"{spec.name}: {result['steps']} steps, event {result['event']}, train {trained:.0f} s, "
            f"evaluate {result['seconds']['evaluate']:.0f} s")


def reevaluate(json_dir: Path, store_root: Path, workers: int) -> None:
    """:func:`reevaluate_one` for every run of ``json_dir`` whose store is in ``store_root``."""
    paths = [p for p in sorted(json_dir.glob("*.json")) if (store_root / p.stem).is_dir()]
    start = time.perf_counter()
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        jobs = [pool.submit(reevaluate_one, str(p), str(store_root)) for p in paths]
        for done, job in enumerate(jobs, 1):
            print(f"[{done}/{len(jobs)} {time.perf_counter() - start:.0f} s] {job.result()}", file=sys.stderr)


# ------------------------------------------------------------------------------------------- tables
class ResultsError(ValueError):
    """A results folder that cannot be read (no results, a file that is not a run's results)."""


def load(json_dir: Path) -> list[dict[str, Any]]:
    """The run results in ``json_dir`` (``{run}.json``, by name).

    Raises:
        ResultsError: no ``*.json`` there, or one that is not a run's results.
    """
    files = sorted(json_dir.glob("*.json")) if json_dir.is_dir() else []
    if not files:
        raise ResultsError(f"no run results (*.json) in {json_dir}")
    runs = []
    for path in files:
        try:
            run = json.loads(path.read_text())
            if not isinstance(run, dict) or not {"spec", "steps", "onset", "event", "detectors"} <= run.keys():
                raise ValueError("missing keys")
        except (OSError, ValueError) as exc:
            raise ResultsError(f"{path}: not a run's results ({exc})") from None
        runs.append(run)
    return runs


def summaries(runs: Sequence[dict[str, Any]], window: int) -> dict[str, dict[str, Summary]]:
    """Per detector and threshold, the summary over the runs that have it."""
    names = list(dict.fromkeys(name for run in runs for name in run["detectors"]))
    out: dict[str, dict[str, Summary]] = {}
    for name in names:
        thresholds = next(run["detectors"][name]["thresholds"] for run in runs if name in run["detectors"])
        out[name] = {}
        for theta in thresholds:
            alarms = [RunAlarms(run["spec"]["kind"], run["steps"], run["onset"], run["event"],
                                run["detectors"][name]["thresholds"][theta]["healthy_alarms"],
                                from_ranges(run["detectors"][name]["thresholds"][theta]["alarms"]))
                      for run in runs if name in run["detectors"]]
            out[name][theta] = summarise(alarms, window)
    return out


def _cell(summary: Summary, fault: str) -> str:
    hits, events = summary.recall(fault)
    if not events and summary.runs.get(fault):
        delays = summary.after_onset.get(fault, [])
        median = f"onset+{np.median(delays):g}" if delays else "-"
        return f"no event: {median} ({len(delays)}/{summary.runs[fault]})"
    lead = summary.median_lead(fault)
    early = summary.early.get(fault, 0)
    return f"{'-' if lead is None else f'{lead:g}'} ({hits}/{events}{f', {early} early' if early else ''})"


def table(runs: Sequence[dict[str, Any]], window: int, budget: float, tuned: bool, markdown: bool,
          compact: bool = False) -> str:
    """One row per detector: false alarms per 10,000 healthy steps and, per fault, median lead (recall).

    ``compact`` leaves out the per-layer rows (``family/column`` series) with no threshold within the budget or
    no alarm in any window (nor after an onset without an event), and says how many it left out.
    """
    defaults = {name: next(r["detectors"][name]["default"] for r in runs if name in r["detectors"])
                for name in dict.fromkeys(n for r in runs for n in r["detectors"])}
    series = {name: next(r["detectors"][name]["series"] for r in runs if name in r["detectors"]) for name in defaults}
    rows, left_out = [], 0
    for name, by_theta in summaries(runs, window).items():
        per_layer = "/" in series[name]
        theta = tune(by_theta, budget) if tuned else defaults[name]
        if theta is None:
            if compact and per_layer:
                left_out += 1
                continue
            rows.append([name, "none within budget", "-", *("-" for _ in FAULTS)])
            continue
        summary = by_theta[theta]
        if compact and per_layer and not any(summary.leads.values()) and not any(summary.after_onset.values()):
            left_out += 1
            continue
        fa = f"{summary.fa_per_10k:.2f} (<= {summary.fa_upper_95:.1f})"
        rows.append([name, theta, fa, *(_cell(summary, fault) for fault in FAULTS)])
    header = ["detector @ series", "threshold", "FA/10k (95% bound)", *FAULTS]
    note = (f"\n\n{left_out} per-layer detectors left out: no threshold within the budget, or no warning"
            if left_out else "")
    return render(header, rows, markdown) + note


def loss_change(run: dict[str, Any], after: int = 100) -> str:
    """The median loss of the ``after`` steps from a fault's onset (up to its event) over that of the 100 steps
    before the onset: how much the fault moved the loss (``-`` for a healthy run)."""
    onset = run["onset"]
    if onset is None:
        return "-"
    losses = np.asarray([float(v) for v in run["losses"]])
    end = min(onset + after, run["event"] + 1 if run["event"] is not None else len(losses))
    before, during = losses[max(0, onset - 100):onset], losses[onset:end]
    return f"{np.median(during) / np.median(before):.2f}x" if len(before) and len(during) else "-"


def runs_table(runs: Sequence[dict[str, Any]], markdown: bool) -> str:
    rows = [[r["spec"]["name"], r["spec"]["variant"] if r["spec"]["kind"] == "healthy" else r["spec"]["kind"],
             str(r["steps"]), str(r["onset"] if r["onset"] is not None else "-"),
             str(r["event"] if r["event"] is not None else "-"), loss_change(r),
             "yes" if r["replay_matches_online"] else "NO"] for r in runs]
    return render(["run", "kind", "steps", "onset", "loss event", "loss from the onset (100 steps) / before",
                   "offline replay = online events"], rows, markdown)


def render(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in [header, *rows])


def report(runs: Sequence[dict[str, Any]], window: int, budget: float, markdown: bool, compact: bool = False) -> str:
    healthy = sum(r["steps"] for r in runs if r["spec"]["kind"] == "healthy")
    before = sum(min(r["onset"], r["steps"]) for r in runs if r["spec"]["kind"] != "healthy")
    series = sorted({s for r in runs for s, about in r["series"].items() if "layers" in about})
    healthy_events = [r["spec"]["name"] for r in runs if r["spec"]["kind"] == "healthy" and r["event"] is not None]
    lines = [f"{len(runs)} runs, {sum(r['steps'] for r in runs)} steps; healthy steps {healthy + before} "
             f"({healthy} in healthy runs, {before} before the fault's onset); lead window {window} steps; "
             f"budget {budget:g} false alarms per 10,000 healthy steps",
             f"per-layer series in the store: {', '.join(series)}",
             f"healthy runs with a loss event: {', '.join(healthy_events) or 'none'}", "",
             runs_table(runs, markdown), "",
             "At each detector's own threshold: median lead in steps (detected / events; early: runs with an alarm "
             "before the window; a fault without a loss event: the first alarm after the onset, runs with one):", "",
             table(runs, window, budget, False, markdown, compact), "",
             f"Same false-alarm rate: the most sensitive threshold of each grid with at most {budget:g} false alarm "
             f"per 10,000 healthy steps:", "", table(runs, window, budget, True, markdown, compact)]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 healthy runs of 700 steps, one run per fault")
    parser.add_argument("--workers", type=int, default=2, help="training processes (default 2)")
    parser.add_argument("--json-dir", type=Path, default=None,
                        help=f"where the per-run results go (default {JSON_DIR.relative_to(ROOT)}; --quick: a "
                             "temporary folder)")
    parser.add_argument("--replace", action="store_true", help="replace the results already in --json-dir")
    parser.add_argument("--from-json", type=Path, default=None, help="recompute the tables from these results")
    parser.add_argument("--store-dir", type=Path, default=None, help="keep the runs' stores here")
    parser.add_argument("--reevaluate", action="store_true",
                        help="no training: evaluate the stores kept in --store-dir again and rewrite --json-dir's "
                             "results (after a change of the detectors)")
    parser.add_argument("--monitor-config", type=str, default=None,
                        help="JSON merged into each run's trainmon config (e.g. to turn on more families)")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="shift every run's seed (held-out runs: --first-seed 1000; default 0, the tuning runs)")
    parser.add_argument("--window", type=int, default=LEAD_WINDOW)
    parser.add_argument("--budget", type=float, default=FA_BUDGET)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--compact", action="store_true",
                        help="leave out the per-layer detectors that never warn or never get within the budget")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.window < 0 or args.budget < 0 or args.first_seed < 0:
        parser.error("--workers must be >= 1, --window, --budget and --first-seed >= 0")
    if args.from_json is not None:
        try:
            runs = load(args.from_json)
        except ResultsError as exc:
            parser.error(str(exc))
        print(report(runs, args.window, args.budget, args.markdown, args.compact))
        return
    extra = None
    if args.monitor_config:
        try:
            extra = json.loads(args.monitor_config)
        except json.JSONDecodeError as exc:
            parser.error(f"--monitor-config is not JSON: {exc}")
        if not isinstance(extra, dict):
            parser.error("--monitor-config must be a JSON object")
    if args.reevaluate:
        if args.store_dir is None or args.json_dir is None:
            parser.error("--reevaluate needs --store-dir (the kept stores) and --json-dir (their results)")
        reevaluate(args.json_dir, args.store_dir, args.workers)
        print(report(load(args.json_dir), args.window, args.budget, args.markdown, args.compact))
        return
    from benchmarks.precursor_runs import plan

    sizes = (4, 700, 1) if args.quick else (8, 2500, 4)
    specs = plan(*sizes, first_seed=args.first_seed)
    temporary = tempfile.mkdtemp(prefix="precursors-")
    json_dir = args.json_dir or (Path(temporary) / "json" if args.quick else JSON_DIR)
    json_dir.mkdir(parents=True, exist_ok=True)
    existing = sorted(json_dir.glob("*.json"))
    if existing and not args.replace:
        parser.error(f"{json_dir} already holds {len(existing)} run results; pass --replace to replace them")
    for path in existing:
        path.unlink()
    store_root = args.store_dir or Path(temporary) / "stores"
    store_root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    ordered = sorted(specs, key=lambda s: -s.steps)  # longest first: the workers finish together
    try:
        with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
            jobs = [pool.submit(run_one, s.to_dict(), str(store_root), str(json_dir), extra) for s in ordered]
            for done, job in enumerate(jobs, 1):
                print(f"[{done}/{len(jobs)} {time.perf_counter() - start:.0f} s] {job.result()}", file=sys.stderr)
    finally:
        if args.store_dir is None:
            shutil.rmtree(Path(temporary) / "stores", ignore_errors=True)
    print(f"{len(specs)} runs in {time.perf_counter() - start:.0f} s with {args.workers} workers "
          f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}); results in {json_dir}\n")
    print(report(load(json_dir), args.window, args.budget, args.markdown, args.compact))


if __name__ == "__main__":
    main()
