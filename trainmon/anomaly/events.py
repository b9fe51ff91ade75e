"""The :class:`AnomalyEvent` record: one line of ``rank{R}/anomalies.jsonl``.

JSON has no NaN or infinity, so non-finite floats are written as the strings ``"nan"``,
``"inf"`` and ``"-inf"`` (the same spelling as the CSV sinks) and read back as floats.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from typing import Any

_NONFINITE_NAMES: dict[str, float] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
WRITE_ORDER: tuple[str, ...] = ("step", "micro_step", "rank", "phase", "pp_stage", "vpp_stage", "order",
                                "detector", "family", "name", "metric", "value", "baseline", "message", "time")
"""Key order of a written event: the sort-key fields first, so ``trainmon analyse`` can read them
from the start of a line without a full JSON parse (readers must not rely on key order). An event whose step's
data is known adds ``batch`` last (:attr:`AnomalyEvent.batch`)."""
NONFINITE = "nonfinite"
"""The detector type that reports NaN and Inf (:mod:`trainmon.anomaly.detectors.nonfinite`)."""
NONFINITE_DETECTORS: frozenset[str] = frozenset({NONFINITE, "AnomalyNan"})
"""Detectors whose events are non-finite values: trainmon's ``nonfinite`` and msprobe's ``AnomalyNan`` rule
(as ``trainmon analyse`` names msprobe's events)."""


def reports_nonfinite(detector: str, value: float) -> bool:
    """Whether an event is a non-finite one (made by a :data:`NONFINITE_DETECTORS` detector, or its value is
    NaN/Inf), as opposed to a spike: what the console never throttles away and ``trainmon analyse`` reports
    as the first non-finite.

    Example:
        >>> [reports_nonfinite(d, v) for d, v in [("nonfinite", 4.0), ("spike", float("inf")), ("spike", 9.0)]]
        [True, True, False]
    """
    return detector in NONFINITE_DETECTORS or not math.isfinite(value)


def utc_now() -> str:
    """The current time as ISO-8601 UTC with milliseconds and a ``Z``: ``2026-11-21T10:00:00.123Z``."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def encode_float(value: float) -> float | str:
    """A float as JSON allows it: finite floats unchanged, NaN/Inf as ``"nan"``/``"inf"``/``"-inf"``."""
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


def decode_float(value: Any) -> float:
    """Inverse of :func:`encode_float`; raises ValueError for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value in _NONFINITE_NAMES:
        return _NONFINITE_NAMES[value]
    raise ValueError(f"expected a number or 'nan'/'inf'/'-inf', got {value!r}")


@dataclass(slots=True)
class AnomalyEvent:
    """One anomaly observed on one rank (schema: DESIGN.md, "AnomalyEvent").

    Attributes:
        step: optimizer step.
        micro_step: micro-step within the step (0 without gradient accumulation).
        rank: global rank that observed it.
        phase: forward, backward, optimizer, communication or loss.
        family: row family (``actv``, ``grad_reduced``, ...) or ``scalars`` for loss/grad norm.
        name: row name (``layers.2.mlp.output``) or scalar name (``loss``).
        metric: the metric that fired (``nans``, ``norm``, ``value`` for scalars, ...).
        value: the observed value.
        baseline: what the detector expected (NaN when it has no baseline).
        detector: detector type that fired (``nonfinite``, ``spike``, ``loss_spike``).
        message: one human-readable line.
        order: position of the observation in execution order on that rank within the step.
        pp_stage: pipeline stage of the rank.
        vpp_stage: virtual-pipeline chunk.
        time: ISO-8601 UTC time with ``Z``.
        batch: the identity of the step's data, where the loop gave it (``monitor.step(batch=...)``,
            ``monitor.batch(...)``, a trainer's callback): ``{"samples": [[start, end], ...]}`` (sample indices,
            half-open ranges) and/or ``{"epoch": e, "batches": [[first, end], ...]}`` (the data loader's batches
            within the epoch); None (not written) when unknown. See docs/actions.md, "Rollback".

    Example:
        >>> e = AnomalyEvent(1, 0, 0, "loss", "scalars", "loss", "value", float("nan"), 2.0,
        ...                  "nonfinite", "loss is nan", 3, 0, 0, "2026-01-01T00:00:00.000Z")
        >>> AnomalyEvent.from_dict(e.to_dict()).to_dict() == e.to_dict()
        True
    """

    step: int
    micro_step: int
    rank: int
    phase: str
    family: str
    name: str
    metric: str
    value: float
    baseline: float
    detector: str
    message: str
    order: int
    pp_stage: int = 0
    vpp_stage: int = 0
    time: str = ""
    batch: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite floats as strings; ``batch`` only when known)."""
        data = {name: getattr(self, name) for name in WRITE_ORDER}
        data["value"] = encode_float(self.value)
        data["baseline"] = encode_float(self.baseline)
        if self.batch is not None:
            data["batch"] = self.batch
        return data

    def to_json(self) -> str:
        """One compact JSON line (no newline)."""
        return json.dumps(self.to_dict(), allow_nan=False, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AnomalyEvent:
        """Build an event from :meth:`to_dict` output.

        Raises:
            ValueError: a field is missing, unknown or of the wrong type.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}")
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                if f.name in ("pp_stage", "vpp_stage", "time", "batch"):
                    continue
                raise ValueError(f"missing field {f.name!r}")
            value = data[f.name]
            if f.name == "batch":
                if value is not None and not isinstance(value, dict):
                    raise ValueError(f"field 'batch' must be an object or null, got {value!r}")
                kwargs[f.name] = value
            elif f.name in ("value", "baseline"):
                kwargs[f.name] = decode_float(value)
            elif f.name in ("step", "micro_step", "rank", "order", "pp_stage", "vpp_stage"):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"field {f.name!r} must be an integer, got {value!r}")
                kwargs[f.name] = value
            else:
                if not isinstance(value, str):
                    raise ValueError(f"field {f.name!r} must be a string, got {value!r}")
                kwargs[f.name] = value
        return cls(**kwargs)

    @classmethod
    def from_json(cls, line: str) -> AnomalyEvent:
        """Parse one ``anomalies.jsonl`` line; raises ValueError when it is not a valid event."""
        return cls.from_dict(json.loads(line))
