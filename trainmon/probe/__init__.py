"""Grad probe: per-parameter gradient summaries, packed gradient directions and their similarity.

- :mod:`trainmon.probe.collector` (torch): the collector an integration builds when
  ``grad_probe.enabled`` is set.
- :mod:`trainmon.probe.storage` (framework-free): the on-disk formats.
- :mod:`trainmon.tools.grad_compare` (framework-free): ``trainmon grad-compare RUN_A RUN_B -o OUT``.

Importing this package imports no framework; see ``docs/grad_probe.md``.
"""

from __future__ import annotations
