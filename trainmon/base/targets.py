"""Selecting modules and parameters by exact name, glob or ``re:`` regex (framework-free)."""

from __future__ import annotations

import difflib
import fnmatch
import logging
import re
from collections.abc import Iterable, Sequence

from trainmon.errors import ConfigError, TargetError

logger = logging.getLogger("trainmon")

OPTIONAL = "optional:"
"""Prefix of a pattern that may match nothing (e.g. ``optional:re:^layers\\.0\\.``); msprobe
targets are translated to such patterns, because msprobe silently skips a target that names nothing."""


WRAPPER_LEVELS = frozenset({"_orig_mod", "_checkpoint_wrapped_module"})
"""Levels that wrappers add to module and parameter names: ``torch.compile``'s ``OptimizedModule`` and
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``'s ``CheckpointWrapper``."""


def plain_name(name: str) -> str:
    """A module or parameter name without the levels of compile and checkpoint wrappers (``WRAPPER_LEVELS``):
    the one rule by which rows are named and targets matched, so that a run with activation checkpointing
    or ``torch.compile`` has the names of one without.

    Example:
        >>> plain_name("layers.0._checkpoint_wrapped_module.mlp.fc1.weight")
        'layers.0.mlp.fc1.weight'
    """
    return ".".join(part for part in name.split(".") if part not in WRAPPER_LEVELS)


def split_optional(pattern: str) -> tuple[str, bool]:
    """``(pattern without the optional: prefix, whether it had one)``."""
    if pattern.startswith(OPTIONAL):
        return pattern[len(OPTIONAL):], True
    return pattern, False


class NamePattern:
    """One name pattern: an exact name or a glob (``layers.*.mlp``), which must match the whole name, or
    ``re:`` and a regex, which is searched (``re.search``: anchor it when needed).

    The one home of name matching: targets, free-benchmark targets and the ``spike`` detector's series.

    Raises:
        re.error: an invalid ``re:`` regex (:func:`compile_pattern` reports it with its key).

    Example:
        >>> NamePattern("layers.*.mlp").matches("layers.3.mlp"), NamePattern("re:mlp$").matches("layers.3.mlp")
        (True, True)
    """

    __slots__ = ("regex", "search", "text", "written")

    def __init__(self, text: str) -> None:
        self.text = text
        self.search = text.startswith("re:")
        self.regex = re.compile(text[3:] if self.search else fnmatch.translate(text))
        self.written = written_as(text)
        """What messages show: the text the user wrote (see :func:`written_as`)."""

    def matches(self, name: str) -> bool:
        """Whether ``name`` is selected."""
        return bool(self.regex.search(name) if self.search else self.regex.fullmatch(name))


_WRITTEN = re.compile(r"re:\(\?#((?:[^\\)]|\\.)*)\)", re.DOTALL)


def labelled(regex: str, written: str) -> str:
    r"""The ``re:`` pattern of ``regex`` that messages show as ``written`` (a translated config's key, e.g. a msprobe
    ``targets`` key): ``written`` rides along as a leading regex comment, ``(?#...)``, which matches nothing.

    Example:
        >>> pattern = labelled("^layers\\.0$", "layers.0")
        >>> pattern, written_as(pattern)
        ('re:(?#layers.0)^layers\\.0$', 'layers.0')
    """
    return "re:(?#" + re.sub(r"([\\)])", r"\\\1", written) + ")" + regex


def written_as(pattern: str) -> str:
    """What messages show for ``pattern`` (no ``optional:`` prefix): the text of a :func:`labelled` pattern,
    else the pattern itself."""
    match = _WRITTEN.match(pattern)
    return re.sub(r"\\(.)", r"\1", match.group(1), flags=re.DOTALL) if match else pattern


def compile_pattern(pattern: str, key: str, error: type[ConfigError] = ConfigError) -> NamePattern:
    """:class:`NamePattern` of ``pattern`` (no ``optional:`` prefix).

    Raises:
        ConfigError: (or ``error``) the pattern is empty or an invalid regex; the key is ``key``.
    """
    if not pattern:
        raise error(key, "must not be empty")
    try:
        return NamePattern(pattern)
    except re.error as exc:
        raise error(key, f"invalid regex {pattern[3:][:60]!r}: {exc}") from None


def check_pattern(pattern: str, key: str) -> None:
    """Check one configured target pattern (``optional:`` prefix allowed) at construction.

    Raises:
        ConfigError: empty, nothing after ``optional:``, or an invalid regex; the key is ``key``.
    """
    if not pattern:
        raise ConfigError(key, "must not be empty")
    pattern, optional = split_optional(pattern)
    if optional and not pattern:
        raise ConfigError(key, f"must name a pattern after {OPTIONAL!r}")
    compile_pattern(pattern, key)


def select(names: Iterable[str], patterns: Sequence[str], key: str) -> list[str]:
    """Names matching any pattern, in their original order.

    A glob or exact name must match the whole name; a ``re:`` regex is searched
    (``re.search``), so anchor it when needed. A pattern prefixed with ``optional:`` may match
    nothing; when every pattern is optional and none matches, one warning says so.

    Raises:
        TargetError: a pattern is not a string, is empty, is an invalid ``re:`` regex, or matches
            nothing (and is not optional); the key is ``{key}[{i}]`` and a pattern that matches
            nothing lists close names.

    Example:
        >>> select(["layers.0.mlp", "layers.1.mlp", "head"], ["layers.*.mlp"], "targets.modules")
        ['layers.0.mlp', 'layers.1.mlp']
        >>> select(["layers.0.mlp", "head"], ["optional:re:^blocks", "head"], "targets.modules")
        ['head']
    """
    names = list(names)
    chosen: set[str] = set()
    if isinstance(patterns, str):
        raise TargetError(key, f"must be a list of patterns, got the string {patterns[:60]!r}")
    for i, given in enumerate(patterns):
        if not isinstance(given, str) or not given:
            raise TargetError(f"{key}[{i}]", f"must be a non-empty string, got {str(given)[:60]!r}")
        pattern, optional = split_optional(given)
        if not pattern:
            raise TargetError(f"{key}[{i}]", f"must name a pattern after {OPTIONAL!r}")
        matcher = compile_pattern(pattern, f"{key}[{i}]", TargetError)
        hits = {n for n in names if matcher.matches(n)}
        if not hits and not optional:
            written = matcher.written
            close = difflib.get_close_matches(written.removeprefix("re:"), names, n=5, cutoff=0.5)
            hint = f"; close names: {close}" if close else f"; some names: {names[:5]}"
            raise TargetError(f"{key}[{i}]", f"pattern {written!r} matches nothing{hint}")
        chosen |= hits
    if patterns and not chosen:
        shown = [written_as(split_optional(p)[0])[:80] for p in patterns[:3]]
        logger.warning("trainmon: %s: no name matches %s%s (optional patterns); nothing is selected; some names: %s",
                       key, shown, " ..." if len(patterns) > 3 else "", names[:5])
    return [n for n in names if n in chosen]
