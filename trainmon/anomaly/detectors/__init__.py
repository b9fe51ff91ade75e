"""Detector registry, spec validation (:func:`check_specs`, called by the config at construction) and
:func:`build_detectors` (called by the anomaly engine)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trainmon.anomaly.detectors.base import Detector
from trainmon.anomaly.detectors.growth import GrowthConfig, GrowthDetector
from trainmon.anomaly.detectors.level import LevelConfig, LevelDetector
from trainmon.anomaly.detectors.loss_spike import LossSpikeConfig, LossSpikeDetector
from trainmon.anomaly.detectors.nonfinite import NonfiniteConfig, NonfiniteDetector
from trainmon.anomaly.detectors.spike import SpikeConfig, SpikeDetector
from trainmon.base.schema import load, spec_wording
from trainmon.errors import ConfigError

DETECTORS: dict[str, type[Detector[object]]] = {
    NonfiniteDetector.type_name: NonfiniteDetector,
    SpikeDetector.type_name: SpikeDetector,
    LossSpikeDetector.type_name: LossSpikeDetector,
    GrowthDetector.type_name: GrowthDetector,
    LevelDetector.type_name: LevelDetector,
}
"""Detector classes by their ``type``."""

PER_LAYER_DEFAULT: dict[str, Any] = {"type": "spike", "series": ["grad_reduced/*/norm"], "method": "log", "persist": 3}
"""The per-layer gradient early warning (docs/anomaly.md): a layer's norm out of band 3 steps in a row."""
GRAD_NORM_DEFAULT: dict[str, Any] = {"type": "spike", "series": ["grad_norm"], "method": "log", "threshold": 7.0,
                                     "min_relative_change": 2.2, "range_factor": 3.0}
"""The global gradient norm watch: a jump above 3.2x its level with z > 7, or above 3x its recent range; tuned on
``benchmarks/anomaly_detectors.py`` to stay under 1 false alarm per 10,000 healthy steps in every regime."""
GRAD_NORM_DROP_DEFAULT: dict[str, Any] = {"type": "spike", "series": ["grad_norm"], "method": "log",
                                          "direction": "down", "threshold": 7.0, "min_relative_change": 9.0,
                                          "range_factor": 10.0}
"""The global grad norm collapsing: below a tenth of its level with z > 7, or below a tenth of the smallest of the
100 norms before the level window (a loss-scale bug, gradients under Adam's epsilon, a detached graph)."""
ATTN_GROWTH_DEFAULT: dict[str, Any] = {"type": "growth", "series": ["attn/*/max_logit"], "window": 40,
                                       "factor": 1.7, "min_value": 25.0, "reduce": "max"}
"""The model's largest attention logit (whichever head holds it) climbing block after block to 1.7x within 40
collected steps, to above 25 (with the attn family on; docs/anomaly.md, "Lead time")."""
EPS_LEVEL_DEFAULT: dict[str, Any] = {"type": "level", "series": ["precursors/*/eps_underflow"], "threshold": 0.9,
                                     "persist": 5}
"""Adam's epsilon underflow: over 90% of a tensor's elements with sqrt(v) < eps, 5 steps in a row (with the
precursors family on)."""
ZERO_GRAD_DEFAULT: dict[str, Any] = {
    "type": "level", "series": ["grad_norm"], "direction": "down", "threshold": 1e-30, "persist": 3,
    "from_below": False,
    "note": "every gradient is zero, nothing trains (a loss that does not depend on the parameters, such as a "
            "cross-entropy over one class, or a graph detached from them)"}
"""The global grad norm exactly 0 (below 1e-30) on 3 collected steps in a row, from the first step on or after a
collapse; once per stretch. The log watches cannot see a 0 (no log level); an overflowed fp16 step's norm is Inf or
absent, never 0."""
DEFAULT_DETECTORS: tuple[dict[str, Any], ...] = (
    {"type": "nonfinite"}, {"type": "loss_spike"}, PER_LAYER_DEFAULT, GRAD_NORM_DEFAULT, GRAD_NORM_DROP_DEFAULT,
    ATTN_GROWTH_DEFAULT, EPS_LEVEL_DEFAULT, ZERO_GRAD_DEFAULT)
"""The detectors that run unless ``anomaly.default_detectors: false``; the user's ``anomaly.detectors`` are added
to them (:func:`effective_specs`). Read-only: copy before changing."""
ADDED_DEFAULTS: tuple[tuple[dict[str, Any], ...], ...] = (
    (GRAD_NORM_DEFAULT,), (GRAD_NORM_DROP_DEFAULT, ATTN_GROWTH_DEFAULT, EPS_LEVEL_DEFAULT), (ZERO_GRAD_DEFAULT,))
"""The defaults added after the first three, in the order they came: an engine state saved before them loads
into the others, and they start fresh."""

__all__ = ["ADDED_DEFAULTS", "ATTN_GROWTH_DEFAULT", "DEFAULT_DETECTORS", "DETECTORS", "Detector", "EPS_LEVEL_DEFAULT",
           "GRAD_NORM_DEFAULT", "GRAD_NORM_DROP_DEFAULT", "GrowthConfig", "GrowthDetector", "LevelConfig",
           "LevelDetector", "LossSpikeConfig", "LossSpikeDetector", "NonfiniteConfig", "NonfiniteDetector",
           "PER_LAYER_DEFAULT", "SERIES_TYPES", "SpikeConfig", "SpikeDetector", "ZERO_GRAD_DEFAULT", "build_detectors",
           "check_specs", "effective_specs", "load_spec"]


def load_spec(spec: object, path: str) -> tuple[type[Detector[object]], object]:
    """The detector class of one spec and its validated config (:mod:`trainmon.base.schema`).

    Raises:
        ConfigError: the spec is not a mapping, has no or an unknown ``type``, or an unknown,
            ill-typed or out-of-range field; the key is ``{path}.{field}``.
    """
    if not isinstance(spec, Mapping):
        raise ConfigError(path, f"must be a mapping like {{type: nonfinite}}, got {type(spec).__name__}")
    kind = spec.get("type")
    if not isinstance(kind, str) or kind not in DETECTORS:
        shown = repr(kind)[:40] if isinstance(kind, (str, type(None))) else type(kind).__name__
        raise ConfigError(f"{path}.type", f"unknown detector {shown}; allowed: {sorted(DETECTORS)}")
    cls = DETECTORS[kind]
    return cls, load(cls.config_class, spec, path, spec_wording("detector", kind))


def _specs(specs: object, path: str) -> list[tuple[type[Detector[object]], object]]:
    if not isinstance(specs, (list, tuple)):
        raise ConfigError(path, f"must be a list of detector specs, got {type(specs).__name__}")
    return [load_spec(spec, f"{path}[{i}]") for i, spec in enumerate(specs)]


def check_specs(specs: Sequence[Mapping[str, Any]], path: str) -> None:
    """Validate detector specs (the ``anomaly.detectors`` check of the config).

    Raises:
        ConfigError: as :func:`build_detectors`.
    """
    _specs(specs, path)


def build_detectors(specs: Sequence[Mapping[str, Any]], path: str = "anomaly.detectors") -> list[Detector[object]]:
    """Validate detector specs and build the detectors, in spec order.

    Args:
        specs: ``[{type: nonfinite|spike|loss_spike|growth|level, ...fields}]``.
        path: dotted config key of the list, used in error messages.

    Raises:
        ConfigError: a spec is not a mapping, has no or an unknown ``type``, or an unknown,
            ill-typed or out-of-range field; the key is ``{path}[{i}].{field}``.

    Example:
        >>> [d.type_name for d in build_detectors([{"type": "nonfinite"}, {"type": "spike", "series": ["loss"]}])]
        ['nonfinite', 'spike']
    """
    return [cls(config) for cls, config in _specs(specs, path)]


SERIES_TYPES: frozenset[str] = frozenset({SpikeDetector.type_name, GrowthDetector.type_name, LevelDetector.type_name})
"""Detector types that watch chosen ``series`` (default ``[loss]``): a user spec of one of them replaces a default
of its type only when they share a series entry."""


def _watched(spec: Mapping[str, Any]) -> tuple[str, frozenset[str]]:
    """What a spec watches: its type and, for the :data:`SERIES_TYPES`, its series (``loss`` when not given)."""
    kind = str(spec.get("type"))
    if kind not in SERIES_TYPES:
        return kind, frozenset()
    series = spec.get("series", ["loss"])
    return kind, frozenset(str(s) for s in series) if isinstance(series, (list, tuple)) else frozenset()


def _replaces(spec: Mapping[str, Any], default: Mapping[str, Any]) -> bool:
    """A user spec replaces a default of its type that watches the same thing (a ``spike``, ``growth`` or ``level``
    sharing a series entry)."""
    kind, series = _watched(spec)
    default_kind, default_series = _watched(default)
    return kind == default_kind and (kind not in SERIES_TYPES or bool(series & default_series))


def effective_specs(specs: Sequence[Mapping[str, Any]], defaults: bool = True) -> list[dict[str, Any]]:
    """The detectors that run: :data:`DEFAULT_DETECTORS` plus the user's ``specs`` (``defaults`` true), or the
    user's ``specs`` alone (``anomaly.default_detectors: false``).

    A user spec replaces the defaults it overlaps instead of running next to them: a ``nonfinite`` or
    ``loss_spike`` spec replaces that default; a ``spike`` spec replaces each default ``spike`` sharing a
    ``series`` entry with it (``series: [grad_norm]`` replaces both grad-norm watches, ``["grad_reduced/*/norm"]``
    the per-layer warning). It takes the place of the first default it replaces; the other user specs follow
    the defaults, in their order.

    Example:
        >>> specs = effective_specs([{"type": "spike", "series": ["grad_norm"]}])
        >>> [s["type"] for s in specs]
        ['nonfinite', 'loss_spike', 'spike', 'spike', 'growth', 'level', 'level']
        >>> specs[3]
        {'type': 'spike', 'series': ['grad_norm']}
        >>> effective_specs([{"type": "nonfinite"}], defaults=False)
        [{'type': 'nonfinite'}]
    """
    users = [dict(spec) for spec in specs]
    if not defaults:
        return users
    out: list[dict[str, Any]] = []
    placed: set[int] = set()
    for default in DEFAULT_DETECTORS:
        replacing = [i for i, spec in enumerate(users) if _replaces(spec, default)]
        if not replacing:
            out.append(dict(default))
        for i in replacing:
            if i not in placed:
                placed.add(i)
                out.append(users[i])
    return out + [spec for i, spec in enumerate(users) if i not in placed]
