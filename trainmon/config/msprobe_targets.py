"""msprobe's ``targets`` keys as trainmon's name patterns (framework-free): modules by exact name, parameters by name
prefix, a ``"{chunk}:"`` prefix dropped, squashed names accepted (:mod:`trainmon.config.msprobe_names`); each
pattern records the msprobe key it comes from (:class:`~trainmon.config.msprobe_checks.MsprobeKeys`)."""

from __future__ import annotations

import re
from typing import Any

from trainmon.base.records import ACTIVATION_KINDS
from trainmon.base.targets import OPTIONAL
from trainmon.config.msprobe_checks import MsprobeKeys
from trainmon.config.msprobe_names import TARGET_SPEC, module_pattern, param_pattern
from trainmon.config.msprobe_notes import MsprobeNotes

__all__ = ["MsprobeTargets"]

_KINDS = tuple(kind for kinds in ACTIVATION_KINDS.values() for kind in kinds)  # msprobe's are trainmon's
_VPP_KEY = re.compile(r"(\d+):(.*)", re.DOTALL)
_PARAM_SWITCHES = ("wg_distribution", "mv_distribution", "ur_distribution", "param_distribution", "mg_direction")
"""The msprobe switches of the families that select parameters by ``targets`` key."""


class MsprobeTargets:
    """The patterns of one msprobe config's target keys (``data`` is the whole config: ``squash_name``, the switches).

    Example:
        >>> from pathlib import Path
        >>> targets = MsprobeTargets({}, MsprobeKeys(Path("monitor.json"), {}), MsprobeNotes())
        >>> targets.split("0:layers.0.mlp")
        'layers.0.mlp'
    """

    def __init__(self, data: dict[str, Any], keys: MsprobeKeys, notes: MsprobeNotes) -> None:
        self.data = data
        self.keys = keys
        self.notes = notes
        self.squash = bool(data.get("squash_name", True))  # msprobe 1.2.1's default (False in 26.x)

    def l2_modules(self, names: list[str], section: str, suffixes: tuple[str, ...]) -> list[str]:
        """The patterns of ``l2_targets`` module names (``"{chunk}:"`` prefix, squashed names), each with each of
        ``suffixes``."""
        hook = "attention_hook" if section == "attention" else "linear_hook"
        key = "modules" if section == "attention" else "params"
        patterns: list[str] = []
        for name in names:
            for suffix in suffixes:
                self.keys.keys[f"features.{section}.{key}[{len(patterns)}]"] = f"l2_targets.{hook}"
                patterns.append(module_pattern(self.split(name) + suffix, self.squash, name + suffix))
        return patterns

    def split(self, key: str) -> str:
        """``key`` without msprobe's ``"{chunk}:"`` prefix (warned about when the chunk is not 0)."""
        match = _VPP_KEY.fullmatch(key)
        if match is None:
            return key
        if match.group(1) != "0":
            self.notes.differs("targets", f"{key!r}: trainmon applies a target to every virtual-pipeline chunk "
                                          f"(msprobe's {match.group(1)}: prefix limits it to chunk {match.group(1)})")
        return match.group(2)

    def modules(self, targets: dict[str, Any], all_xy: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        """The ``targets`` section (its ``modules``) and the ``activations`` settings of msprobe's module selection."""
        for key, spec in targets.items():
            self._check_specs(key, spec)
        if all_xy or self.data.get("print_struct"):
            # msprobe hooks every module of named_modules(), the root ("", rows ".input", ...) first
            return {"modules": [f"{OPTIONAL}*"]}, {"root": True}
        patterns: list[str] = []
        for key in targets:
            name = self.split(key)
            if name:  # "" is the root module: activations.root
                self.keys.keys[f"targets.modules[{len(patterns)}]"] = _target_key(key)
                patterns.append(module_pattern(name, self.squash, key))
        root = {"root": True} if "" in map(self.split, targets) else {}
        return {"modules": patterns}, root  # modules: [] when the root is the only module key

    def key_patterns(self, targets: dict[str, Any], by_module: bool) -> None:
        """What each ``targets`` key selects on its own (:attr:`MsprobeKeys.targets`), to report at ``attach`` the
        keys that select nothing monitored: modules when they are hooked by key, parameters when a family of
        theirs is on."""
        by_param = any(self.data.get(key) for key in _PARAM_SWITCHES)
        for key in targets if by_module or by_param else ():
            name = self.split(key)
            modules = (module_pattern(name, self.squash, key) if name else f"{OPTIONAL}re:^$") if by_module else None
            params = (f"{OPTIONAL}*" if "0:".startswith(key) else param_pattern(name, self.squash and name != key, key)
                      ) if by_param else None
            self.keys.targets[key] = (modules, params)

    def _check_specs(self, key: str, spec: dict[str, Any]) -> None:
        for kind, value in spec.items():
            if kind not in _KINDS:
                self.notes.cannot(f"targets.{key}.{kind}", "msprobe knows input, output, input_grad and output_grad")
            elif not isinstance(value, str) or TARGET_SPEC.fullmatch(value) is None:
                self.notes.cannot(f"targets.{key}.{kind}", f"spec {str(value)[:40]!r} is neither 'tensor' nor "
                                                           "'tuple[n]:i' (msprobe ignores it too)")

    def params(self, targets: dict[str, Any]) -> list[str]:
        """msprobe's parameter rule: the name, ``"0:" + name`` or ``"0:" + squashed name`` starts with a key."""
        patterns: list[str] = []
        for key in targets:
            if "0:".startswith(key):  # "", "0" and "0:" are prefixes of every "0:{name}"
                return ["*"]
            name = self.split(key)
            self.keys.keys[f"targets.params[{len(patterns)}]"] = _target_key(key)
            patterns.append(param_pattern(name, self.squash and name != key, key))
        return patterns



def _target_key(key: str) -> str:
    """How messages name a msprobe ``targets`` key."""
    return f"targets.{key}" if key else 'targets.""'
