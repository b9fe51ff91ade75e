"""Detector registry, spec validation (:func:`check_specs`, called by the config at construction) and
:func:`build_detectors` (called by the anomaly engine)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trainmon.anomaly.detectors.base import Detector
from trainmon.anomaly.detectors.loss_spike import LossSpikeConfig, LossSpikeDetector
from trainmon.anomaly.detectors.nonfinite import NonfiniteConfig, NonfiniteDetector
from trainmon.anomaly.detectors.spike import SpikeConfig, SpikeDetector
from trainmon.base.schema import load, spec_wording
from trainmon.errors import ConfigError

DETECTORS: dict[str, type[Detector[object]]] = {
    NonfiniteDetector.type_name: NonfiniteDetector,
    SpikeDetector.type_name: SpikeDetector,
    LossSpikeDetector.type_name: LossSpikeDetector,
}
"""Detector classes by their ``type``."""

__all__ = ["DETECTORS", "Detector", "LossSpikeConfig", "LossSpikeDetector", "NonfiniteConfig",
           "NonfiniteDetector", "SpikeConfig", "SpikeDetector", "build_detectors", "check_specs", "load_spec"]


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
        specs: ``[{type: nonfinite|spike|loss_spike, ...fields}]``.
        path: dotted config key of the list, used in error messages.

    Raises:
        ConfigError: a spec is not a mapping, has no or an unknown ``type``, or an unknown,
            ill-typed or out-of-range field; the key is ``{path}[{i}].{field}``.

    Example:
        >>> [d.type_name for d in build_detectors([{"type": "nonfinite"}, {"type": "spike", "series": ["loss"]}])]
        ['nonfinite', 'spike']
    """
    return [cls(config) for cls, config in _specs(specs, path)]
