"""trainmon: a drop-in training monitor for PyTorch, DeepSpeed, Megatron-Core and MindSpore.

``import trainmon`` imports no framework: torch is imported when a model is attached, and
DeepSpeed, Megatron-Core and MindSpore only by their integrations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainmon.config import MonitorConfig, load_config
from trainmon.errors import AnomalyError, ConfigError, TargetError, UnsupportedSetupError
from trainmon.monitor import TrainerMonitor
from trainmon.version import __version__

if TYPE_CHECKING:
    from trainmon.anomaly.events import AnomalyEvent


def __getattr__(name: str) -> Any:
    if name == "AnomalyEvent":
        from trainmon.anomaly.events import AnomalyEvent

        return AnomalyEvent
    raise AttributeError(f"module 'trainmon' has no attribute {name!r}")


__all__ = ["AnomalyError", "AnomalyEvent", "ConfigError", "MonitorConfig", "TargetError", "TrainerMonitor",
           "UnsupportedSetupError", "__version__", "load_config"]
