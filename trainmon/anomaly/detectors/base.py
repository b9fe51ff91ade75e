"""Detector base class, typed detector specs, and event construction helpers."""

from __future__ import annotations

import dataclasses
import typing
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from trainmon.anomaly.events import AnomalyEvent
from trainmon.config import convert_value
from trainmon.errors import ConfigError
from trainmon.records import Row, StepRecord

SCALAR_FAMILY = "scalars"
"""Family of events raised on ``record.scalars`` (loss, grad_norm, lr/group0, ...)."""


class Detector(ABC):
    """A host-side detector: floats of one step in, events out.

    Subclasses set :attr:`type_name` and :attr:`config_class` (a dataclass with a docstring
    per field) and implement :meth:`update`. State must never hold NaN or Inf.
    """

    type_name: ClassVar[str]
    config_class: ClassVar[type]
    choices: ClassVar[dict[str, tuple[Any, ...]]] = {}
    minimum: ClassVar[dict[str, float]] = {}
    maximum: ClassVar[dict[str, float]] = {}

    def __init__(self, config: Any, path: str = "anomaly.detectors[0]") -> None:
        """Args: config: the parsed spec; path: its dotted config key (for errors)."""
        self.config = config

    @abstractmethod
    def update(self, record: StepRecord, time: str) -> list[AnomalyEvent]:
        """Observe one collected step; return the events it raises (any order)."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible state for checkpoints."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        if not isinstance(state, Mapping):
            raise ValueError(f"{self.type_name} state must be a mapping, got {type(state).__name__}")


# --------------------------------------------------------------------------- spec parsing
def parse_spec(detector: type[Detector], spec: Mapping[str, Any], path: str) -> Any:
    """Build ``detector.config_class`` from a spec dict (without ``type``).

    Raises:
        ConfigError: unknown key, wrong type, value not among the choices, below the minimum or
            above the maximum; the key is ``{path}.{field}``.
    """
    cls = detector.config_class
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in spec.items():
        if key == "type":
            continue
        if key not in hints:
            raise ConfigError(f"{path}.{key}", f"unknown key for detector {detector.type_name!r}; "
                                               f"allowed: {['type', *names]}")
        value = convert_value(value, hints[key], f"{path}.{key}")
        allowed = detector.choices.get(key)
        if allowed is not None:
            for item in value if isinstance(value, list) else [value]:
                if item not in allowed:
                    raise ConfigError(f"{path}.{key}", f"{item!r} is not allowed; allowed: {list(allowed)}")
        low = detector.minimum.get(key)
        if low is not None and value is not None and value < low:
            raise ConfigError(f"{path}.{key}", f"must be >= {low:g}, got {value}")
        high = detector.maximum.get(key)
        if high is not None and value is not None and value > high:
            raise ConfigError(f"{path}.{key}", f"must be <= {high:g}, got {str(value)[:30]}")
        kwargs[key] = value
    return cls(**kwargs)


# --------------------------------------------------------------------------- event helpers
def row_event(record: StepRecord, row: Row, *, metric: str, value: float, baseline: float,
              detector: str, message: str, time: str) -> AnomalyEvent:
    """An event located at a statistics row."""
    key = row.key
    return AnomalyEvent(step=record.step, micro_step=key.micro_step, rank=record.rank, phase=key.phase,
                        family=key.family, name=key.name, metric=metric, value=value, baseline=baseline,
                        detector=detector, message=message, order=key.order, pp_stage=record.pp_stage,
                        vpp_stage=key.vpp_stage, time=time)


def scalar_location(record: StepRecord, name: str) -> tuple[str, int, int]:
    """``(phase, micro_step, order)`` of a scalar: the loss ends the forward pass of the last
    micro-step; other scalars (grad_norm, lr) belong to the optimizer, after every row."""
    last_micro = max((row.key.micro_step for row in record.rows), default=0)
    after_rows = max((row.key.order for row in record.rows), default=-1) + 1
    return ("loss" if name == "loss" else "optimizer"), last_micro, after_rows


def scalar_event(record: StepRecord, name: str, *, value: float, baseline: float, detector: str,
                 message: str, time: str) -> AnomalyEvent:
    """An event located at a scalar of the record."""
    phase, micro_step, order = scalar_location(record, name)
    return AnomalyEvent(step=record.step, micro_step=micro_step, rank=record.rank, phase=phase,
                        family=SCALAR_FAMILY, name=name, metric="value", value=value, baseline=baseline,
                        detector=detector, message=message, order=order, pp_stage=record.pp_stage,
                        vpp_stage=0, time=time)
