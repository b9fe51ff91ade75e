"""Labelled benchmark of loss and gradient-norm spike detectors: trainmon's against its peers'.

    python benchmarks/anomaly_detectors.py [--quick] [--markdown] [--curves benchmarks/data/curves.npz]

Healthy curves: seven regimes of real small torch models (``benchmarks/detector_curves.py`` trains
them once and caches them in ``benchmarks/data/curves.npz``) and three synthetic ones made here
(``ar_noise``: AR(1) log-noise, phi 0.9; ``heavy_tail``: Student-t log-noise, 3 degrees of freedom;
``slow_drift``: a random walk in the log level plus noise). Each curve has a loss, a global gradient
norm and four per-layer gradient norms.

Events of known size and shape are injected at known steps (at least 200 steps in, so every peer is
past its warm-up) into copies of the healthy loss (and, for the grad-norm table, gradient norm):

- ``spike`` x1.5, x2, x3, x4, x8, x10: one step multiplied; caught only at that step;
- ``plateau`` x2, x3: 20 steps multiplied; caught within them;
- ``diverge``: the loss doubles every 50 steps from the event on; caught within 200 steps;
- ``nan``, ``inf``: one non-finite loss; caught at that step;
- ``blowup`` (recorded, not injected): one layer's weights diverge along one direction in a real
  run (see ``detector_curves.py``); per-layer detectors should fire before the loss detector.

A detector is run once over each healthy curve (its alarms there are false alarms, reported per
10,000 steps and regime) and, for each event, from a copy of its state at the event's first step over
the event's window; an alarm counts as a detection only at a step where the healthy run had none.

``--quick`` is the CI form (one run per regime, fewer events; ``tests/unit/test_detector_benchmark.py``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.detector_baselines import (  # noqa: E402
    FoundryKillLossSpike,
    LightningSpike,
    MegatronLarge,
    MsprobeTurbulence,
    OlmoStability,
    TrainmonLossSpikeV0,
)
from trainmon.anomaly.detectors import (  # noqa: E402
    DEFAULT_DETECTORS,
    PER_LAYER_DEFAULT,
    build_detectors,
)
from trainmon.base.records import Row, RowKey, StepRecord  # noqa: E402

CURVES = ROOT / "benchmarks" / "data" / "curves.npz"
REAL_REGIMES = ("large_batch", "small_batch", "warmup_decay", "data_mix", "periodic_eval", "restart", "curriculum")
SYNTHETIC_REGIMES = ("ar_noise", "heavy_tail", "slow_drift")
SPIKES = (1.5, 2.0, 3.0, 4.0, 8.0, 10.0)
PLATEAU_STEPS = 20
DIVERGE_STEPS = 200
DIVERGE_DOUBLING = 50
FIRST_EVENT = 200
EVENTS: tuple[tuple[str, float | None], ...] = (
    *(("spike", k) for k in SPIKES), ("plateau", 2.0), ("plateau", 3.0), ("diverge", 2.0), ("nan", None), ("inf", None))
_DRAW_ORDER = (*(e for e in EVENTS if e != ("spike", 8.0)), ("spike", 8.0))
"""Where each event is drawn: x8 (added later) last, so the other events keep their steps."""


def event_label(kind: str, size: float | None) -> str:
    if kind in ("spike", "plateau"):
        return f"{kind} x{size:g}"
    return kind


# --------------------------------------------------------------------------------------- curves
@dataclass
class Curve:
    """One healthy run: ``values[:, 0]`` loss, ``[:, 1]`` global grad norm, ``[:, 2:]`` layer grad norms."""

    regime: str
    run: int
    values: np.ndarray
    layer_names: list[str]
    blowups: list[Blowup] = field(default_factory=list)

    def series(self, kind: str) -> np.ndarray:
        return {"loss": self.values[:, 0], "grad_norm": self.values[:, 1], "layers": self.values[:, 2:]}[kind]


@dataclass
class Blowup:
    """A fork of a healthy curve at ``start``: ``values`` replace the curve's from there on."""

    start: int
    layer: int
    values: np.ndarray
    ended: str  # "nonfinite": the next step was no longer finite; "steps": it ran its course


def _decode(deltas: np.ndarray, offsets: np.ndarray, resolution: float) -> np.ndarray:
    return np.exp(offsets + np.cumsum(deltas.astype(np.int64), axis=0) * resolution)


def load_curves(path: Path = CURVES, runs: int | None = None) -> list[Curve]:
    """The cached real curves (and their blow-up forks), ``runs`` per regime (all by default)."""
    with np.load(path) as data:
        meta = json.loads(bytes(data["meta"]).decode())
        resolution = meta["resolution"]
        curves: dict[tuple[str, int], Curve] = {}
        for regime, info in meta["regimes"].items():
            for run in range(info["runs"] if runs is None else min(runs, info["runs"])):
                values = _decode(data[f"{regime}/{run}/d"], data[f"{regime}/{run}/o"], resolution)
                curves[(regime, run)] = Curve(regime, run, values, list(info["layers"]))
        for item in meta["blowups"]:
            curve = curves.get((item["regime"], item["run"]))
            if curve is not None:
                values = _decode(data[item["key"] + "/d"], data[item["key"] + "/o"], resolution)
                curve.blowups.append(Blowup(item["start"], item["layer"], values, item["ended"]))
    return list(curves.values())


def synthetic_curve(regime: str, run: int, steps: int) -> Curve:
    """A synthetic healthy curve: a decaying trend times log-noise of the regime's kind."""
    rng = np.random.default_rng([SYNTHETIC_REGIMES.index(regime), run])
    t = np.arange(steps)
    columns = []
    for channel in range(6):
        loss_like = channel == 0
        tau = rng.uniform(300, 900) if loss_like else rng.uniform(100, 400)
        scale = rng.uniform(0.5, 3.0) if loss_like else rng.uniform(0.05, 1.0)
        trend = scale * (rng.uniform(0.5, 3.0) * np.exp(-t / tau) + 1.0)
        sd = 0.08 if loss_like else 0.2  # stationary log-noise of the loss / of gradient norms
        if regime == "ar_noise":
            phi = 0.9
            innovations = rng.standard_normal(steps) * sd * math.sqrt(1 - phi ** 2)
            noise = np.empty(steps)
            level = rng.standard_normal() * sd
            for i in range(steps):
                level = phi * level + innovations[i]
                noise[i] = level
        elif regime == "heavy_tail":
            noise = rng.standard_t(3, steps) * (0.02 if loss_like else 0.04)
        else:  # slow_drift
            noise = np.cumsum(rng.standard_normal(steps) * (0.005 if loss_like else 0.01))
            noise += rng.standard_normal(steps) * (0.03 if loss_like else 0.1)
        columns.append(trend * np.exp(noise))
    return Curve(regime, run, np.stack(columns, axis=1), [f"layers.{i}.weight" for i in range(4)])


def all_curves(path: Path = CURVES, runs: int | None = None, steps: int = 3000) -> list[Curve]:
    curves = load_curves(path, runs)
    synthetic_runs = runs if runs is not None else max(1, len(curves) // len(REAL_REGIMES))
    return curves + [synthetic_curve(r, i, steps) for r in SYNTHETIC_REGIMES for i in range(synthetic_runs)]


# --------------------------------------------------------------------------------------- events
def event_window(kind: str, size: float | None, values: np.ndarray, start: int) -> np.ndarray:
    """The series from ``start`` over the event's window, with the event applied."""
    length = {"plateau": PLATEAU_STEPS, "diverge": DIVERGE_STEPS}.get(kind, 1)
    window = values[start:start + length].astype(np.float64).copy()
    if kind in ("spike", "plateau"):
        window *= size
    elif kind == "diverge":
        window *= 2.0 ** (np.arange(len(window)) / DIVERGE_DOUBLING)
    elif kind == "nan":
        window[:] = math.nan
    elif kind == "inf":
        window[:] = math.inf
    return window


def event_starts(curve: Curve, per_curve: int) -> dict[tuple[str, float | None], list[int]]:
    """Where each event kind is injected in ``curve`` (fixed by the curve's regime and run)."""
    rng = np.random.default_rng([len(curve.regime), sum(map(ord, curve.regime)), curve.run])
    last = len(curve.values) - DIVERGE_STEPS - 1
    starts = {event: sorted(int(s) for s in rng.integers(FIRST_EVENT, last, per_curve)) for event in _DRAW_ORDER}
    return {event: starts[event] for event in EVENTS}


# --------------------------------------------------------------------------------------- adapters
class TrainmonScalar:
    """trainmon detectors built from specs, fed one scalar (``loss`` or ``grad_norm``) per step."""

    def __init__(self, specs: list[dict[str, Any]], name: str) -> None:
        self.detectors = build_detectors(specs)
        self.name = name
        self.step = 0

    def update(self, value: float) -> bool:
        record = StepRecord(step=self.step, rank=0, scalars={self.name: float(value)})
        self.step += 1
        fired = False
        for detector in self.detectors:
            if detector.update(record, ""):
                fired = True
        return fired


class TrainmonLayers:
    """trainmon detectors fed the per-layer gradient norms as ``grad_reduced`` rows."""

    def __init__(self, specs: list[dict[str, Any]], names: Sequence[str]) -> None:
        self.detectors = build_detectors(specs)
        self.keys = [RowKey("grad_reduced", name, 0, 0, i) for i, name in enumerate(names)]
        self.step = 0
        self.fired_layers: list[str] = []

    def update(self, values: np.ndarray) -> bool:
        rows = [Row(key, self.step, {"norm": float(v)}, not math.isfinite(v)) for key, v in zip(self.keys, values)]
        record = StepRecord(step=self.step, rank=0, rows=rows)
        self.step += 1
        self.fired_layers = [e.name for d in self.detectors for e in d.update(record, "")]
        return bool(self.fired_layers)


class PerLayer:
    """A peer's single-series rule applied to each layer's norm separately (as msprobe and Megatron do)."""

    def __init__(self, make: Callable[[], Any], names: Sequence[str]) -> None:
        self.rules = [make() for _ in names]
        self.names = list(names)
        self.fired_layers: list[str] = []

    def update(self, values: np.ndarray) -> bool:
        self.fired_layers = [name for rule, name, v in zip(self.rules, self.names, values) if rule.update(float(v))]
        return bool(self.fired_layers)


DetectorFactory = Callable[[Curve], Any]

TRAINMON_DEFAULT = [dict(s) for s in DEFAULT_DETECTORS
                    if s["type"] in ("nonfinite", "loss_spike") or "loss" in s.get("series", ())]
"""The default ``anomaly.detectors`` that watch the loss."""
TRAINMON_GRAD_DEFAULT = [{"type": "nonfinite", "scalars": ["grad_norm"]},
                         *(dict(s) for s in DEFAULT_DETECTORS if "grad_norm" in s.get("series", ()))]
"""The default global grad-norm watches (with the default ``nonfinite`` on ``grad_norm``): the spike watch
(:data:`GRAD_NORM_DEFAULT`) and any other default on ``grad_norm``."""
TRAINMON_GRAD = [{"type": "nonfinite", "scalars": ["grad_norm"]},
                 {"type": "spike", "series": ["grad_norm"], "method": "log"}]
TRAINMON_LAYERS = [dict(PER_LAYER_DEFAULT)]
"""The per-layer early warning of docs/anomaly.md."""
TRAINMON_BEFORE_TREND = [{"type": "nonfinite"}, {"type": "loss_spike", "trend_factor": 0}]
"""The default loss detectors without the trend rule (what the trend rule adds)."""

LOSS_DETECTORS: dict[str, DetectorFactory] = {
    "trainmon default": lambda c: TrainmonScalar(TRAINMON_DEFAULT, "loss"),
    "trainmon default without trend": lambda c: TrainmonScalar(TRAINMON_BEFORE_TREND, "loss"),
    "trainmon before (v0 loss_spike)": lambda c: TrainmonLossSpikeV0(),
    "trainmon spike ema": lambda c: TrainmonScalar([{"type": "nonfinite"}, {"type": "spike"}], "loss"),
    "trainmon spike mad": lambda c: TrainmonScalar([{"type": "nonfinite"}, {"type": "spike", "method": "mad"}], "loss"),
    "Lightning SpikeDetection": lambda c: LightningSpike(),
    "OLMo-core StabilityMonitor": lambda c: OlmoStability(),
    "Megatron spiky loss + NaN/Inf": lambda c: MegatronLarge(),
    "llm-foundry KillLossSpike": lambda c: FoundryKillLossSpike(total_steps=len(c.values)),
    "msprobe 1.2.1 Turbulence": lambda c: MsprobeTurbulence("1.2.1"),
    "msprobe 26.2 Turbulence EMA": lambda c: MsprobeTurbulence("ema"),
}
GRAD_DETECTORS: dict[str, DetectorFactory] = {
    "trainmon default (grad_norm)": lambda c: TrainmonScalar(TRAINMON_GRAD_DEFAULT, "grad_norm"),
    "trainmon spike log (grad_norm)": lambda c: TrainmonScalar(TRAINMON_GRAD, "grad_norm"),
    "trainmon spike mad (grad_norm)": lambda c: TrainmonScalar(
        [TRAINMON_GRAD[0], {"type": "spike", "series": ["grad_norm"], "method": "mad", "min_relative_change": 1.0}],
        "grad_norm"),
    "OLMo-core StabilityMonitor": lambda c: OlmoStability(),
    "Megatron large grads + NaN/Inf": lambda c: MegatronLarge(),
    "msprobe 1.2.1 Turbulence": lambda c: MsprobeTurbulence("1.2.1"),
    "msprobe 26.2 Turbulence EMA": lambda c: MsprobeTurbulence("ema"),
}
LAYER_DETECTORS: dict[str, DetectorFactory] = {
    "trainmon spike log persist 3": lambda c: TrainmonLayers(TRAINMON_LAYERS, c.layer_names),
    "trainmon spike mad (before)": lambda c: TrainmonLayers(
        [{"type": "spike", "series": ["grad_reduced/*/norm"], "method": "mad", "min_relative_change": 1.0}],
        c.layer_names),
    "Megatron large grads (per bucket)": lambda c: PerLayer(MegatronLarge, c.layer_names),
    "msprobe 1.2.1 Turbulence": lambda c: PerLayer(lambda: MsprobeTurbulence("1.2.1"), c.layer_names),
    "msprobe 26.2 Turbulence EMA": lambda c: PerLayer(lambda: MsprobeTurbulence("ema"), c.layer_names),
}


# --------------------------------------------------------------------------------------- evaluation
@dataclass
class Results:
    """Per detector: alarms and steps on healthy curves by regime, and each event's outcome."""

    alarms: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    steps: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    # (detector, regime, label) -> delays (None: missed)
    outcomes: dict[tuple[str, str, str], list[int | None]] = field(default_factory=lambda: defaultdict(list))
    # (detector, regime, run, blowup index) -> (first alarm in the fork or None, layers named)
    blowups: dict[tuple[str, str, int, int], tuple[int | None, list[str]]] = field(default_factory=dict)


def evaluate(name: str, factory: DetectorFactory, curves: Sequence[Curve], series: str, per_curve: int,
             results: Results, events: bool = True) -> None:
    """Run one detector over every healthy curve, then over each event window from a copy of its state."""
    for curve in curves:
        values = curve.series(series)
        windows: list[tuple[str, int, np.ndarray]] = []  # (label, start, window)
        if events and series != "layers":
            for (kind, size), starts in event_starts(curve, per_curve).items():
                windows += [(event_label(kind, size), s, event_window(kind, size, values, s)) for s in starts]
        for index, blowup in enumerate(curve.blowups):
            fork = blowup.values[:, {"loss": slice(0, 1), "grad_norm": slice(1, 2), "layers": slice(2, None)}[series]]
            windows.append((f"blowup{index}", blowup.start, fork if series == "layers" else fork[:, 0]))
        starts_needed = {start for _, start, _ in windows}
        snapshots: dict[int, Any] = {}
        detector = factory(curve)
        healthy: set[int] = set()
        for t in range(len(values)):
            if t in starts_needed:
                snapshots[t] = copy.deepcopy(detector)
            if detector.update(values[t]):
                healthy.add(t)
        results.alarms[(name, curve.regime)] += len(healthy)
        results.steps[(name, curve.regime)] += len(values)
        for label, start, window in windows:
            detector = copy.deepcopy(snapshots[start])
            delay, named = None, []
            for k in range(len(window)):
                if detector.update(window[k]) and start + k not in healthy:
                    delay, named = k, list(getattr(detector, "fired_layers", []))
                    break
            if label.startswith("blowup"):
                results.blowups[(name, curve.regime, curve.run, int(label[6:]))] = (delay, named)
            else:
                results.outcomes[(name, curve.regime, label)].append(delay)


def run_benchmark(curves: Sequence[Curve], per_curve: int,
                  detectors: dict[str, dict[str, DetectorFactory]] | None = None) -> dict[str, Results]:
    """Evaluate every detector family: ``{"loss": ..., "grad_norm": ..., "layers": ...}``."""
    detectors = detectors or {"loss": LOSS_DETECTORS, "grad_norm": GRAD_DETECTORS, "layers": LAYER_DETECTORS}
    out = {}
    for series, family in detectors.items():
        results = Results()
        for name, factory in family.items():
            evaluate(name, factory, curves, series, per_curve, results)
        out[series] = results
    return out


# --------------------------------------------------------------------------------------- summaries
def recall(results: Results, name: str, label: str, regimes: Sequence[str] | None = None) -> tuple[int, int]:
    hits = total = 0
    for (detector, regime, event), delays in results.outcomes.items():
        if detector == name and event == label and (regimes is None or regime in regimes):
            hits += sum(d is not None for d in delays)
            total += len(delays)
    return hits, total


def median_delay(results: Results, name: str, label: str) -> float | None:
    delays = [d for (detector, _, event), ds in results.outcomes.items() if detector == name and event == label
              for d in ds if d is not None]
    return statistics.median(delays) if delays else None


def false_alarms(results: Results, name: str, regime: str | None = None) -> float:
    """False alarms per 10,000 healthy steps (in ``regime``, or over all)."""
    keys = [k for k in results.steps if k[0] == name and (regime is None or k[1] == regime)]
    steps = sum(results.steps[k] for k in keys)
    return 1e4 * sum(results.alarms[k] for k in keys) / steps if steps else math.nan


def worst_false_alarms(results: Results, name: str) -> tuple[float, str]:
    """The highest false-alarm rate over the regimes, and its regime (``all`` when it is 0)."""
    regimes = sorted({k[1] for k in results.steps if k[0] == name})
    worst, regime = max((false_alarms(results, name, r), r) for r in regimes)
    return worst, regime if worst > 0 else "all"


def regimes_of(results: Results) -> list[str]:
    seen = {k[1] for k in results.steps}
    return [r for r in (*REAL_REGIMES, *SYNTHETIC_REGIMES) if r in seen]


def healthy_extremes(curves: Sequence[Curve], column: int = 0) -> dict[str, tuple[float, float]]:
    """Per regime, how far healthy values stray upwards: the 99.99th percentile of value / (median of
    the 7 before), and the largest value / (largest of the 100 before those): why a spike of a given
    size cannot be told from a healthy step there."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for curve in curves:
        x = curve.values[:, column]
        windows = np.lib.stride_tricks.sliding_window_view(x, 107)[:-1]
        level = np.median(windows[:, -7:], axis=1)
        older = windows[:, :100].max(axis=1)
        ratios, ranges = out.setdefault(curve.regime, ([], []))
        ratios.extend(x[107:] / level)
        ranges.extend(x[107:] / older)
    return {r: (float(np.quantile(a, 0.9999)), float(np.max(b))) for r, (a, b) in out.items()}


def blowup_leads(results: Results, layer_detector: str, loss_results: Results, loss_detector: str,
                 curves: Sequence[Curve]) -> list[dict[str, Any]]:
    """Per blow-up: the first per-layer alarm, the loss alarm (a fork that ended non-finite counts as
    caught on the next step, where the loss is NaN/Inf), the step the loss moved (the median of its
    last 5 values passed 1.5x its median over the 100 steps before the fork), and whether the first
    alarm named the diverging layer (or a layer next to it)."""
    rows = []
    for curve in curves:
        for index, blowup in enumerate(curve.blowups):
            layer_at, named = results.blowups[(layer_detector, curve.regime, curve.run, index)]
            loss_at, _ = loss_results.blowups[(loss_detector, curve.regime, curve.run, index)]
            if loss_at is None and blowup.ended == "nonfinite":
                loss_at = len(blowup.values)
            level = float(np.median(curve.values[max(0, blowup.start - 100):blowup.start, 0]))
            losses = blowup.values[:, 0]
            moved = next((k for k in range(len(losses)) if np.median(losses[max(0, k - 4):k + 1]) > 1.5 * level), None)
            if moved is None and blowup.ended == "nonfinite":
                moved = len(blowup.values)
            positions = [curve.layer_names.index(n) for n in named if n in curve.layer_names]
            rows.append({"regime": curve.regime, "run": curve.run, "layer": curve.layer_names[blowup.layer],
                         "layer_alarm": layer_at, "loss_alarm": loss_at, "loss_moved": moved,
                         "named": blowup.layer in positions,
                         "adjacent": any(abs(p - blowup.layer) <= 1 for p in positions),
                         "steps": len(blowup.values)})
    return rows


def blowup_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts and median leads (in steps) of :func:`blowup_leads` rows."""
    def ahead(key: str) -> list[dict[str, Any]]:
        return [r for r in rows if r["layer_alarm"] is not None and (r[key] is None or r["layer_alarm"] < r[key])]

    def leads(key: str) -> list[int]:
        return [r[key] - r["layer_alarm"] for r in rows if r["layer_alarm"] is not None and r[key] is not None]

    return {"blowups": len(rows), "fired": sum(r["layer_alarm"] is not None for r in rows),
            "before_loss_alarm": len(ahead("loss_alarm")), "before_loss_moved": len(ahead("loss_moved")),
            "lead_alarm": statistics.median(leads("loss_alarm")) if leads("loss_alarm") else None,
            "lead_alarm_min": min(leads("loss_alarm"), default=None),
            "lead_moved": statistics.median(leads("loss_moved")) if leads("loss_moved") else None,
            "named": sum(r["named"] for r in rows), "adjacent": sum(r["adjacent"] for r in rows)}


def _pct(hits: int, total: int) -> str:
    return f"{100 * hits / total:.0f}%" if total else "-"


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


LABELS = [event_label(k, s) for k, s in EVENTS]


def detector_table(results: Results, markdown: bool) -> str:
    """One row per detector: recall by event, median delays, false alarms (worst regime, overall)."""
    header = ["detector", *LABELS, "delay plateau/diverge", "FA/10k worst regime", "FA/10k all"]
    rows = []
    for name in dict.fromkeys(k[0] for k in results.steps):
        worst, regime = worst_false_alarms(results, name)
        plateau, diverge = median_delay(results, name, "plateau x2"), median_delay(results, name, "diverge")
        rows.append([name, *(_pct(*recall(results, name, label)) for label in LABELS),
                     f"{_fmt(plateau, 0)}/{_fmt(diverge, 0)}",
                     f"{worst:.1f} ({regime})" + ("" if worst <= 1.0 else " **over**"),
                     f"{false_alarms(results, name):.2f}"])
    return _render(header, rows, markdown)


def regime_table(results: Results, name: str, extremes: dict[str, tuple[float, float]], markdown: bool) -> str:
    """Recall by event and regime and false alarms per regime, for one detector, next to how far the
    regime's healthy values stray (the reason a spike size is missed there)."""
    rows = []
    for regime in regimes_of(results):
        high, top = extremes.get(regime, (math.nan, math.nan))
        rows.append([regime, *(_pct(*recall(results, name, label, [regime])) for label in LABELS),
                     f"{false_alarms(results, name, regime):.1f}", f"{high:.2f}x", f"{top:.2f}x"])
    return _render(["regime", *LABELS, "FA/10k", "healthy value/level p99.99", "healthy value/range max"],
                   rows, markdown)


def layer_table(results: Results, loss_results: Results, curves: Sequence[Curve], markdown: bool) -> str:
    """Per-layer detectors: healthy false alarms and what they did on the blow-ups."""
    rows = []
    for name in dict.fromkeys(k[0] for k in results.steps):
        worst, regime = worst_false_alarms(results, name)
        summary = blowup_summary(blowup_leads(results, name, loss_results, "trainmon default", curves))
        n = summary["blowups"]
        rows.append([name, f"{worst:.1f} ({regime})", f"{false_alarms(results, name):.2f}", f"{summary['fired']}/{n}",
                     f"{summary['before_loss_alarm']}/{n}", _fmt(summary["lead_alarm"], 0),
                     f"{summary['before_loss_moved']}/{n}", _fmt(summary["lead_moved"], 0),
                     f"{summary['named']} / {summary['adjacent']} of {n}"])
    return _render(["detector", "FA/10k worst regime", "FA/10k all", "blow-ups caught", "before the loss alarm",
                    "median lead (steps)", "before the loss moved", "median lead (steps)",
                    "named the layer / it or a neighbour"], rows, markdown)


def _render(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in [header, *rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--curves", type=Path, default=CURVES)
    parser.add_argument("--quick", action="store_true", help="the CI form: one run per regime, 3 events per kind")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--per-curve", type=int, default=None, help="events of each kind per curve (default 10)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    curves = all_curves(args.curves, runs=1 if args.quick else None)
    per_curve = args.per_curve or (3 if args.quick else 10)
    out = run_benchmark(curves, per_curve)
    md = args.markdown
    print(f"{len(curves)} healthy curves ({len({c.regime for c in curves})} regimes), "
          f"{sum(len(c.values) for c in curves)} steps, {per_curve} events of each kind per curve, "
          f"{sum(len(c.blowups) for c in curves)} blow-ups; {time.perf_counter() - start:.0f} s\n")
    print("Loss (recall by event; median delay in steps; false alarms per 10,000 healthy steps):\n"
          + detector_table(out["loss"], md) + "\n")
    print("trainmon default by regime:\n" + regime_table(out["loss"], "trainmon default", healthy_extremes(curves), md)
          + "\n")
    print("Global grad norm:\n" + detector_table(out["grad_norm"], md) + "\n")
    print("trainmon default (grad_norm) by regime:\n" + regime_table(
        out["grad_norm"], "trainmon default (grad_norm)", healthy_extremes(curves, column=1), md) + "\n")
    print("Per-layer grad norms: healthy false alarms and blow-ups (one layer's weights diverging):\n"
          + layer_table(out["layers"], out["loss"], curves, md))


if __name__ == "__main__":
    main()
