"""Detector registry and :func:`build_detectors` (called by the config at construction)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trainmon.anomaly.detectors.base import Detector, parse_spec
from trainmon.anomaly.detectors.loss_spike import LossSpikeConfig, LossSpikeDetector
from trainmon.anomaly.detectors.nonfinite import NonfiniteConfig, NonfiniteDetector
from trainmon.anomaly.detectors.spike import SpikeConfig, SpikeDetector
from trainmon.errors import ConfigError

DETECTORS: dict[str, type[Detector]] = {
    NonfiniteDetector.type_name: NonfiniteDetector,
    SpikeDetector.type_name: SpikeDetector,
    LossSpikeDetector.type_name: LossSpikeDetector,
}
"""Detector classes by their ``type``."""

__all__ = ["DETECTORS", "Detector", "LossSpikeConfig", "LossSpikeDetector", "NonfiniteConfig",
           "NonfiniteDetector", "SpikeConfig", "SpikeDetector", "build_detectors"]


def build_detectors(specs: Sequence[Mapping[str, Any]], path: str = "anomaly.detectors") -> list[Detector]:
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
    if not isinstance(specs, (list, tuple)):
        raise ConfigError(path, f"must be a list of detector specs, got {type(specs).__name__}")
    detectors: list[Detector] = []
    for i, spec in enumerate(specs):
        item = f"{path}[{i}]"
        if not isinstance(spec, Mapping):
            raise ConfigError(item, f"must be a mapping like {{type: nonfinite}}, got {type(spec).__name__}")
        kind = spec.get("type")
        if not isinstance(kind, str) or kind not in DETECTORS:
            shown = repr(kind)[:40] if isinstance(kind, (str, type(None))) else type(kind).__name__
            raise ConfigError(f"{item}.type", f"unknown detector {shown}; allowed: {sorted(DETECTORS)}")
        cls = DETECTORS[kind]
        config = parse_spec(cls, spec, item)
        detectors.append(cls(config, item))
    return detectors
