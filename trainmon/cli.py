"""Deprecated alias: the command line moved to :mod:`trainmon.tools.cli`.

A ``trainmon`` command installed before the move imports ``trainmon.cli:main``; reinstalling trainmon
(``pip install -e .``) points it at the new home. Kept for one release, then removed.
"""

from __future__ import annotations

import warnings

from trainmon.tools.cli import main

warnings.warn("trainmon: trainmon.cli is deprecated (the command is trainmon.tools.cli:main); reinstall trainmon "
              "so that the `trainmon` command imports it", DeprecationWarning, stacklevel=2)

__all__ = ["main"]
