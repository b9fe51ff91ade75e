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
    from trainmon.actions.resume import Rollback, read_rollback
    from trainmon.actions.rollback import RollbackExit
    from trainmon.actions.skip_list import SkipList, SkipSampler
    from trainmon.anomaly.events import AnomalyEvent

_LAZY = {"AnomalyEvent": "trainmon.anomaly.events", "Rollback": "trainmon.actions.resume",
         "RollbackExit": "trainmon.actions.rollback", "read_rollback": "trainmon.actions.resume",
         "SkipList": "trainmon.actions.skip_list", "SkipSampler": "trainmon.actions.skip_list"}
"""Names imported on first use (framework-free, but not needed by ``import trainmon``)."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainmon' has no attribute {name!r}")


__all__ = ["AnomalyError", "AnomalyEvent", "ConfigError", "MonitorConfig", "Rollback", "RollbackExit", "SkipList",
           "SkipSampler", "TargetError", "TrainerMonitor", "UnsupportedSetupError", "__version__", "load_config",
           "read_rollback"]
