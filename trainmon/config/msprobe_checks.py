"""The value types msprobe accepts in its monitor config (``validate_config`` of the ``mindstudio-probe``
wheel), checked before :mod:`trainmon.config.msprobe` translates a config (framework-free): :func:`check_types`
rejects what msprobe rejects, :data:`KNOWN_KEYS` names every top-level key msprobe knows; :class:`MsprobeKeys`
rewords the errors of the translated config with msprobe's keys.
"""

from __future__ import annotations

import difflib
import itertools
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from trainmon.base.targets import NamePattern, split_optional
from trainmon.errors import ConfigError

logger = logging.getLogger("trainmon")
_VPP_PREFIX = re.compile(r"^\d+:")

_BOOL_KEYS = ("print_struct", "ur_distribution", "xy_distribution", "all_xy", "forward_only", "backward_only",
              "mv_distribution", "wg_distribution", "mg_distribution", "param_distribution", "mg_direction",
              "squash_name", "switch", "dynamic_on", "stack_info", "monitor_mbs_grad", "recording_l2_features")
L2_HOOKS = ("linear_hook", "attention_hook")
"""msprobe's feature hooks (``MonitorConst.L2_HOOKS``): the keys of ``l2_targets``."""
SA_ORDERS = ("s,b,h,d", "b,s,h,d")
"""msprobe's ``sa_order`` values (spaces removed): the layout of the query and key an ``attention_hook`` module gets."""
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
    for hook, names in data.get("l2_targets", {}).items():
        yield f"l2_targets.{hook}", f"one of {list(L2_HOOKS)}", hook, lambda value: value in L2_HOOKS
        yield f"l2_targets.{hook}", "a list of module names", names, _list_of(_is(str))
    if "sa_order" in data:
        yield "sa_order", f"one of {list(SA_ORDERS)}", data["sa_order"], \
            lambda value: isinstance(value, str) and value.replace(" ", "") in SA_ORDERS


def check_types(data: dict[str, Any], path: Path) -> None:
    """Reject the value types msprobe rejects (``validate_config``); the rest is checked by trainmon's schema."""
    top = ((key, what, data[key], fits) for key, (what, fits) in _TYPES.items() if key in data)
    for key, what, value, fits in itertools.chain(top, _nested_values(data)):
        if not fits(value):
            raise ConfigError(str(path), f"msprobe key {key}: must be {what}, got {str(value)[:60]!r}")


@dataclass
class MsprobeKeys:
    """Which msprobe key each trainmon key of a translated msprobe config comes from, so that an error raised
    later (when the config is built, at ``attach``) names msprobe's key and the file, and the ``targets`` keys
    that name nothing in the model are reported as the user wrote them.

    Example:
        >>> keys = MsprobeKeys(Path("monitor.json"), {"ranks": "module_ranks"})
        >>> str(keys.reword(ConfigError("ranks[1]", "must be >= 0, got -1")))
        'monitor.json: msprobe key module_ranks[1]: must be >= 0, got -1'
    """

    path: Path
    """The msprobe config file."""
    keys: dict[str, str] = field(default_factory=dict)
    """trainmon dotted key -> the msprobe key it was translated from (a key's items and fields follow it)."""
    targets: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    """msprobe ``targets`` key -> the module pattern and the parameter pattern of that key alone (None: that kind is
    not selected by key); the root module is named ``""``."""

    def msprobe_key(self, key: str) -> str | None:
        """The msprobe key of trainmon ``key`` (``ranks[1]`` -> ``module_ranks[1]``), or None."""
        for ours, theirs in self.keys.items():
            if key == ours or key.startswith((ours + "[", ours + ".")):
                return theirs + key[len(ours):]
        return None

    def reword(self, error: ConfigError) -> ConfigError:
        """``error`` (a :class:`ConfigError` or subclass, from the translated config) as the msprobe user reads it:
        the file and msprobe's key, or the trainmon key it was translated to when no msprobe key maps to it."""
        theirs = self.msprobe_key(error.key)
        where = f"msprobe key {theirs}" if theirs else f"{error.key} (of the trainmon config translated from it)"
        return type(error)(str(self.path), f"{where}: {error.reason}")

    def unmatched_targets(self, module_names: Sequence[str], param_names: Sequence[str]) -> list[str]:
        """The ``targets`` keys that select no module and no parameter (of the kinds selected by key)."""
        def hits(pattern: str | None, names: Sequence[str]) -> bool:
            if pattern is None:
                return False
            matcher = NamePattern(split_optional(pattern)[0])
            return any(matcher.matches(name) for name in names)

        return [key for key, (modules, params) in self.targets.items()
                if not hits(modules, module_names) and not hits(params, param_names)]

    def warn_unmatched_targets(self, module_names: Sequence[str], param_names: Sequence[str]) -> None:
        """One warning per ``targets`` key that selects nothing in the model (msprobe skips such a key silently),
        with the model's names closest to it."""
        names = [name for name in (*module_names, *param_names) if name]  # not the root's ""
        for key in self.unmatched_targets(module_names, param_names):
            close = difflib.get_close_matches(_VPP_PREFIX.sub("", key), names, n=5, cutoff=0.5)
            logger.warning("trainmon: msprobe targets key %r (%s) selects no module or parameter of this model; it "
                           "is skipped, as msprobe skips it; %s: %s", key, self.path,
                           "close names" if close else "some names", close or names[:5])
