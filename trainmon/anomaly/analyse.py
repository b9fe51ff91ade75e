"""Deprecated alias: ``analyse_run`` moved to :mod:`trainmon.anomaly.merge` (the command to
:mod:`trainmon.tools.analyse`).

Kept for one release, then removed.
"""

from __future__ import annotations

import warnings

from trainmon.anomaly.merge import analyse_run

warnings.warn("trainmon: trainmon.anomaly.analyse is deprecated; import analyse_run from trainmon.anomaly.merge",
              DeprecationWarning, stacklevel=2)

__all__ = ["analyse_run"]
