"""One schema for every config section and detector spec: typed dataclass fields and their rules.

A section (or a detector's spec) is a dataclass whose fields carry their type annotation and, through
:func:`setting`, their rules: ``choices``, a ``minimum``/``maximum`` (inclusive) or ``above`` (exclusive)
bound, ``unique`` items, and a ``check`` function for anything else (a regex that must compile, bounds
that must increase). Rules apply to each item of a list. A section may define ``cross_check(self, path)``
for rules that join several fields. :func:`load` builds a section from a mapping (or a section object)
and raises :class:`~trainmon.errors.ConfigError` naming the dotted key of the first mistake.

Framework-free; imports nothing of trainmon but its errors.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Section:
    ...     interval: int = setting(1, minimum=1)
    ...     mode: str = setting("fast", choices=("fast", "exact"))
    >>> load(Section, {"interval": 5}).interval
    5
    >>> load(Section, {"mode": "slow"}, "section")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ConfigError: section.mode: 'slow' is not allowed; choose from ['fast', 'exact']
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, Union

from trainmon.errors import ConfigError

T = TypeVar("T")
Check = Callable[[Any, str], None]
"""A rule of its own: called with the converted value (never None) and its dotted key; raises ConfigError."""

INT64_MAX = 2**63 - 1
_RULES = ("choices", "minimum", "maximum", "above", "unique", "check")


def setting(default: Any = dataclasses.MISSING, *, choices: tuple[Any, ...] | None = None,
            minimum: float | None = None, maximum: float | None = None, above: float | None = None,
            unique: bool = False, check: Check | None = None) -> Any:
    """A dataclass field with its validation rules in ``metadata``.

    Args:
        default: the default value; a list or dict default is copied for each instance.
        choices: the allowed values (of each item, for a list).
        minimum: the smallest allowed value (of each item); ``maximum``: the largest.
        above: the value must be greater than this.
        unique: a list may not repeat an item.
        check: a rule of its own (see :data:`Check`).
    """
    metadata = {"choices": choices, "minimum": minimum, "maximum": maximum, "above": above,
                "unique": unique or None, "check": check}
    metadata = {key: value for key, value in metadata.items() if value is not None}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def each(check: Check) -> Check:
    """A :data:`Check` of a list that applies ``check`` to every item, at the key ``{path}[{i}]``."""

    def check_items(values: list[Any], path: str) -> None:
        for i, value in enumerate(values):
            check(value, f"{path}[{i}]")

    return check_items


# --------------------------------------------------------------------------- wording
@dataclasses.dataclass(frozen=True)
class Wording:
    """How the errors of one kind of document are worded (as users have always seen them).

    Attributes:
        owner: ``""`` for a config section; ``"detector 'spike'"`` for a spec of a registry entry, whose
            unknown keys are listed with its ``type`` key, in field order.
        item_keys: a list item breaking a rule is named ``{key}[{i}]`` (else the list's key).
    """

    owner: str = ""
    item_keys: bool = True

    @property
    def skipped(self) -> frozenset[str]:
        """Keys that select the entry (``type``) and are no field of its spec."""
        return frozenset({"type"}) if self.owner else frozenset()

    def unknown_key(self, names: list[str]) -> str:
        if self.owner:
            return f"unknown key for {self.owner}; allowed: {['type', *names]}"
        return f"unknown key; valid keys here: {sorted(names)}"


SECTION = Wording()
"""The wording of the config file's sections."""


def spec_wording(kind: str, type_name: str) -> Wording:
    """The wording of the spec of one registry entry (``spec_wording("detector", "spike")``)."""
    return Wording(owner=f"{kind} {type_name!r}", item_keys=False)


# --------------------------------------------------------------------------- loading
def load(cls: type[T], data: Mapping[str, Any] | T, path: str = "", wording: Wording = SECTION) -> T:
    """Build the section ``cls`` from ``data``: every key converted to its field's type and checked.

    Args:
        cls: a dataclass whose fields may carry :func:`setting` rules.
        data: a mapping of field names to values, or a ``cls`` object (checked again).
        path: the dotted key of the section in error messages (``""`` at the top level).
        wording: how errors are worded (:data:`SECTION` or :func:`spec_wording`).

    Raises:
        ConfigError: an unknown key, a value of the wrong type, a broken rule; the key is ``{path}.{field}``.
    """
    if isinstance(data, cls):
        data = dataclasses.asdict(data)  # type: ignore[call-overload]  # a deep copy
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():  # type: ignore[union-attr]
        if key in wording.skipped:
            continue
        name = key if isinstance(key, str) and key and key.strip() == key else repr(key)  # '' or ' x' quoted
        where = f"{path}.{name}" if path else name
        if key not in fields:
            raise ConfigError(where, wording.unknown_key(list(fields)))
        kwargs[key] = convert_value(value, hints[key], where)
        check_rules(kwargs[key], fields[key].metadata, where, wording)
    obj = cls(**kwargs)
    for f in fields.values():  # checks of their own run on every field, defaults too, after the types
        check = f.metadata.get("check")
        value = getattr(obj, f.name)
        if check is not None and value is not None:
            check(value, f"{path}.{f.name}" if path else f.name)
    cross_check = getattr(obj, "cross_check", None)
    if cross_check is not None:
        cross_check(path)
    return obj


def check_rules(value: Any, rules: Mapping[str, Any], path: str, wording: Wording = SECTION) -> None:
    """Check a converted value against its field's ``choices``, ``unique`` and bounds (each item of a list).

    Raises:
        ConfigError: the first item that breaks a rule.
    """
    if value is None or not rules:
        return
    items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]

    def key(i: int | None) -> str:
        return path if i is None or not wording.item_keys else f"{path}[{i}]"

    allowed = rules.get("choices")
    seen: set[Any] = set()
    for i, item in items:
        if allowed is not None and item not in allowed:
            raise ConfigError(key(i), f"{item!r} is not allowed; choose from {list(allowed)}")
        if rules.get("unique"):
            if item in seen:
                raise ConfigError(key(i), f"{item!r} is listed twice")
            seen.add(item)
        _check_bounds(item, rules, key(i))


def _check_bounds(value: Any, rules: Mapping[str, Any], path: str) -> None:
    low, high, above = rules.get("minimum"), rules.get("maximum"), rules.get("above")
    if low is not None and value < low:
        raise ConfigError(path, f"must be >= {low:g}, got {short(value)}")
    if above is not None and not value > above:
        raise ConfigError(path, f"must be > {above:g}, got {short(value)}")
    if high is not None and value > high:
        raise ConfigError(path, f"must be <= {high:g}, got {short(value)}")


# --------------------------------------------------------------------------- types
def type_name(tp: object) -> str:
    """A readable name for a type annotation (error messages, docs/config.md)."""
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def convert_value(value: object, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (sections built with :func:`load`).

    Raises:
        ConfigError: the value does not fit; the message names ``path``.

    Example:
        >>> convert_value(3, float, "eps"), convert_value(None, int | None, "collect_times")
        (3.0, None)
    """
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return _to_optional(value, typing.get_args(tp), path)
    if dataclasses.is_dataclass(tp):
        return _to_section(value, tp, path)  # type: ignore[arg-type]
    if origin is list:
        return _to_list(value, typing.get_args(tp)[0], path)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"must be a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is Any:
        return value
    convert = _SCALARS.get(tp)
    if convert is None:  # pragma: no cover - a field type the schema does not know
        raise AssertionError(f"unsupported annotation {type_name(tp)} at {path}")
    return convert(value, path)


def _to_optional(value: object, args: tuple[Any, ...], path: str) -> Any:
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(path, "must not be null")
    (inner,) = [a for a in args if a is not type(None)]
    return convert_value(value, inner, path)


def _to_section(value: object, cls: type[Any], path: str) -> Any:
    if not isinstance(value, (Mapping, cls)):
        raise ConfigError(path, f"must be a mapping with keys {sorted(f.name for f in dataclasses.fields(cls))}")
    return load(cls, value, path)


def _to_list(value: object, inner: Any, path: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(path, f"must be a list, got {type(value).__name__}")
    return [convert_value(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]


def _to_bool(value: object, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(path, f"must be true or false, got {short(value)}")
    return value


def _to_int(value: object, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(path, f"must be an integer, got {short(value)}")
    if not -INT64_MAX <= value <= INT64_MAX:
        raise ConfigError(path, f"must be an integer of at most 19 digits (|x| <= 2**63-1), got {short(value)}")
    return value


def _to_float(value: object, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(path, f"must be a finite number, got {short(value)}")
    return float(value)


def _to_str(value: object, path: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(path, f"must be a string, got {short(value)}")
    if "\0" in value:
        raise ConfigError(path, "must not contain a NUL character")
    return value


_SCALARS: dict[type, Callable[[object, str], object]] = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def short(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (a 10,000-digit number or a huge list stays one short line)."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # ints beyond the digit limit, self-referencing lists
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."
