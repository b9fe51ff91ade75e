"""Anomaly detection on the host side of the pipeline (framework-free).

Detectors see the finalised floats of a collected step; events are ordered earliest first
(first origin) and handed to the actions. See ``docs/anomaly.md``.
"""

from __future__ import annotations

from trainmon.anomaly.engine import AnomalyEngine
from trainmon.anomaly.events import AnomalyEvent

__all__ = ["AnomalyEngine", "AnomalyEvent"]
