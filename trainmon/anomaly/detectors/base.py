"""Detector base class, typed detector specs, and event construction helpers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, TypeVar

from trainmon.anomaly.events import AnomalyEvent
from trainmon.base.records import Row, StepRecord
from trainmon.errors import ConfigError

SpecT = TypeVar("SpecT", covariant=True)
"""The spec (config) class of a detector."""

SCALAR_FAMILY = "scalars"
"""Family of events raised on ``record.scalars`` (loss, grad_norm, lr/group0, ...)."""


class Detector(ABC, Generic[SpecT]):
    """A host-side detector: floats of one step in, events out.

    Subclasses set :attr:`type_name` and :attr:`config_class` (a dataclass with a docstring and
    :func:`~trainmon.base.schema.setting` rules per field: :func:`~trainmon.anomaly.detectors.build_detectors`
    validates a spec against it) and implement :meth:`update`. State must never hold NaN or Inf.
    """

    type_name: ClassVar[str]
    config_class: ClassVar[type]  # SpecT's class (a class variable cannot name a type variable)

    def __init__(self, config: SpecT) -> None:
        """Args: config: the spec, a :attr:`config_class` object."""
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


# --------------------------------------------------------------------------- spec rules
def off_or_above_one(factor: float, path: str) -> None:
    """A factor that is 0 (rule off) or above 1 (:data:`~trainmon.base.schema.Check` of the log-level rules)."""
    if factor and factor <= 1:
        raise ConfigError(path, f"must be 0 (off) or > 1, got {factor}")


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
