"""Exceptions raised to the user."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid. ``key`` is the dotted key (or the file) at fault."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


class TargetError(ConfigError):
    """A target pattern matched no module or parameter of the attached model."""


class UnsupportedSetupError(ValueError):
    """``attach`` refuses a set-up that trainmon cannot monitor correctly (never half-monitored): the message
    names the set-up and what to do instead."""


class AnomalyError(RuntimeError):
    """Raised at the end of a step by the ``raise`` anomaly action."""


class UsageError(Exception):
    """Bad command-line usage: the ``trainmon`` command reports it as one line and exits with code 2."""
