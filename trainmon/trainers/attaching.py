"""How every trainer callback attaches its monitor when training starts (:func:`attach_or_train_on`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from trainmon.errors import ConfigError, UnsupportedSetupError

logger = logging.getLogger("trainmon")


def attach_or_train_on(attach: Callable[[], None], release: Callable[[], None], run: str) -> None:
    """Attach (``attach()``) when a trainer starts training, after ``release()`` of any earlier monitor.

    A refusal (:class:`ConfigError`, :class:`UnsupportedSetupError`) is raised: its message says what to
    change, before the first step. Any other exception of trainmon's is warned about and training goes on
    without the monitor; ``run`` names the run in that warning (``this Trainer``, ``this Lightning run``).
    """
    release()
    try:
        attach()
    except (ConfigError, UnsupportedSetupError):
        release()
        raise
    except Exception as exc:
        release()
        logger.warning("trainmon: could not attach to %s (%s: %s); training goes on without the monitor", run,
                       type(exc).__name__, exc)
