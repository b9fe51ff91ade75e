"""Field rules that several config sections share: a ``metrics`` list and a list of name patterns.

Example:
    >>> from dataclasses import dataclass
    >>> from trainmon.base.schema import load
    >>> @dataclass
    ... class Section:
    ...     metrics: list[str] = metric_list()
    >>> load(Section, {"metrics": ["norm", "max"]}).metrics
    ['norm', 'max']
"""

from __future__ import annotations

from typing import Any

from trainmon.base.records import METRICS
from trainmon.base.schema import each, setting
from trainmon.base.targets import check_pattern

__all__ = ["metric_list", "pattern_list"]


def metric_list() -> Any:
    """The ``metrics`` field of a section: any of :data:`~trainmon.base.records.METRICS`, each once; default all."""
    return setting(list(METRICS), choices=METRICS, unique=True)


def pattern_list(default: list[str]) -> Any:
    """A list of name patterns (:mod:`trainmon.base.targets`), each checked at construction."""
    return setting(default, check=each(check_pattern))
