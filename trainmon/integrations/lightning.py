"""Deprecated alias: the Lightning callback moved to :mod:`trainmon.trainers.lightning`.

Kept for one release, then removed.
"""

from __future__ import annotations

import warnings

from trainmon.trainers.lightning import TrainmonCallback

warnings.warn("trainmon: trainmon.integrations.lightning is deprecated; "
              "import TrainmonCallback from trainmon.trainers.lightning", DeprecationWarning, stacklevel=2)

__all__ = ["TrainmonCallback"]
