"""The value types msprobe accepts in its monitor config (``validate_config`` of the ``mindstudio-probe``
wheel), checked before :mod:`trainmon.config.msprobe` translates a config (framework-free): :func:`check_types`
rejects what msprobe rejects, :data:`KNOWN_KEYS` names every top-level key msprobe knows.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeGuard

from trainmon.errors import ConfigError

_BOOL_KEYS = ("print_struct", "ur_distribution", "xy_distribution", "all_xy", "forward_only", "backward_only",
              "mv_distribution", "wg_distribution", "mg_distribution", "param_distribution", "mg_direction",
              "squash_name", "switch", "dynamic_on", "stack_info", "monitor_mbs_grad", "recording_l2_features")
_INT_KEYS = ("start_step", "step_interval", "collect_times", "step_count_per_record", "ndigits")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is(kind: type) -> Callable[[object], bool]:
    return lambda value: isinstance(value, kind)


def _list_of(fits: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: isinstance(value, list) and all(fits(item) for item in value)


_TYPES: dict[str, tuple[str, Callable[[object], bool]]] = {
    "ops": ("a list of strings", _list_of(_is(str))),
    "module_ranks": ("a list of integers", _list_of(_is_int)),
    **{key: ("a JSON object", _is(dict)) for key in ("targets", "alert", "l2_targets", "cc_distribution")},
    **{key: ("true or false", _is(bool)) for key in _BOOL_KEYS},
    **{key: ("an integer", _is_int) for key in _INT_KEYS},
    "eps": ("a number", _is_number),
    "format": ("a string", _is(str)),
    "append_output": ("a list", _is(list)),
}
"""The value types msprobe accepts for its top-level keys (``validate_config``): ``(what, test)``."""
KNOWN_KEYS = frozenset({*_TYPES, "start_step", "step_interval", "collect_times", "print_struct", "sa_order"})


def _nested_values(data: dict[str, Any]) -> Iterator[tuple[str, str, object, Callable[[object], bool]]]:
    """``(key, what, value, test)`` of the nested values msprobe checks, each once the ones above it passed."""
    for key, spec in data.get("targets", {}).items():
        yield f"targets.{key}", "a JSON object (e.g. {} or {\"input\": \"tensor\"})", spec, _is(dict)
    yield ("cc_distribution.cc_codeline", "a list of strings", data.get("cc_distribution", {}).get("cc_codeline", []),
           _list_of(_is(str)))
    alert = data.get("alert", {})
    rules = alert.get("rules") or []
    yield "alert.rules", "a list of JSON objects", rules, _list_of(_is(dict))
    for i, rule in enumerate(rules):
        args = rule.get("args") or {}
        yield f"alert.rules[{i}].args", "a JSON object", args, _is(dict)
        yield (f"alert.rules[{i}].args.threshold", "a number >= 0", args.get("threshold", 0.5),
               lambda value: value is None or (_is_number(value) and value >= 0))
    if "dump" in alert:
        yield "alert.dump", "true or false", alert["dump"], _is(bool)


def check_types(data: dict[str, Any], path: Path) -> None:
    """Reject the value types msprobe rejects (``validate_config``); the rest is checked by trainmon's schema."""
    top = ((key, what, data[key], fits) for key, (what, fits) in _TYPES.items() if key in data)
    for key, what, value, fits in itertools.chain(top, _nested_values(data)):
        if not fits(value):
            raise ConfigError(str(path), f"msprobe key {key}: must be {what}, got {str(value)[:60]!r}")
