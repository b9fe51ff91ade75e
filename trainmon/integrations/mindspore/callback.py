"""Deprecated alias: the MindSpore Model.train callback moved to :mod:`trainmon.trainers.mindspore`.

Kept for one release, then removed.
"""

from __future__ import annotations

import warnings

from trainmon.trainers.mindspore import TrainmonCallback

warnings.warn("trainmon: trainmon.integrations.mindspore.callback is deprecated; "
              "import TrainmonCallback from trainmon.trainers.mindspore", DeprecationWarning, stacklevel=2)

__all__ = ["TrainmonCallback"]
