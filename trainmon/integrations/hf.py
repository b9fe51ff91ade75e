"""Deprecated alias: the HF Trainer callback moved to :mod:`trainmon.trainers.hf`.

Kept for one release, then removed.
"""

from __future__ import annotations

import warnings

from trainmon.trainers.hf import TrainmonCallback

warnings.warn("trainmon: trainmon.integrations.hf is deprecated; "
              "import TrainmonCallback from trainmon.trainers.hf", DeprecationWarning, stacklevel=2)

__all__ = ["TrainmonCallback"]
