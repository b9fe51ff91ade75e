"""The warnings of a msprobe config translation (framework-free): a msprobe key that cannot be honoured as msprobe
means it, or that is honoured with a difference, is warned about once, with the reason."""

from __future__ import annotations

import logging
from typing import Any

from trainmon.config.msprobe_checks import KNOWN_KEYS

__all__ = ["MsprobeNotes"]

logger = logging.getLogger("trainmon")


class MsprobeNotes:
    """The warnings of one translation, each ``(key, reason)`` once.

    Example:
        >>> notes = MsprobeNotes()
        >>> notes.cannot("ndigits", "trainmon writes every value at full precision")
        >>> sorted(notes.warned)
        [('ndigits', 'trainmon writes every value at full precision')]
    """

    def __init__(self) -> None:
        self.warned: set[tuple[str, str]] = set()

    def cannot(self, key: str, why: str) -> None:
        self.warn_once("trainmon: msprobe config key %s is not honoured (%s)", key, why)

    def differs(self, key: str, why: str) -> None:
        self.warn_once("trainmon: msprobe config key %s is honoured with a difference: %s", key, why)

    def warn_once(self, text: str, key: str, why: str) -> None:
        if (key, why) not in self.warned:
            self.warned.add((key, why))
            logger.warning(text, key, why)

    def rest(self, data: dict[str, Any]) -> None:
        """Warn about the keys no family translates: ``ndigits``, ``switch``, ``squash_name``, unknown keys, ..."""
        dynamic = ("msprobe reads it in dynamic mode (DYNAMIC_MONITOR=true) only; trainmon does not re-read a "
                   "msprobe file while training: convert it to a trainmon YAML file and set dynamic.watch: true")
        not_honoured = [
            ("ndigits", "ndigits" in data, "trainmon writes every value at full precision"),
            ("step_count_per_record", data.get("step_count_per_record", 1) != 1,
             "trainmon writes one CSV per family; its step column says which step a row belongs to"),
            ("append_output", bool(data.get("append_output")), "set run_name to the run to continue: trainmon "
                                                               "appends to it"),
            ("switch", "switch" in data, dynamic),
            ("dynamic_on", "dynamic_on" in data, dynamic),
            ("mg_distribution", bool(data.get("mg_distribution")), "msprobe itself only checks its type; "
             "mg_direction is the key that compares gradient and momentum directions"),
            ("stack_info", bool(data.get("stack_info")), "trainmon records call stacks of the dumped modules only "
                                                         "(dump.stack)"),
            *((key, True, "msprobe 1.2.1 and 26.x have no such monitor key") for key in data if key not in KNOWN_KEYS),
        ]
        if data.get("squash_name"):
            self.differs("squash_name", "trainmon writes full module and parameter names; msprobe's squashed "
                                        "name is the part after the first layers. (docs/msprobe.md); targets "
                                        "given as squashed names still select the same modules")
        for key, applies, why in not_honoured:
            if applies:
                self.cannot(key, why)
