"""Translate a msprobe monitor JSON config into a trainmon config dict (framework-free)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from trainmon.config import parse_json, read_text
from trainmon.errors import ConfigError

logger = logging.getLogger("trainmon")

_OPS = {"norm": "norm", "min": "min", "max": "max", "mean": "mean", "zeros": "zeros", "nans": "nans"}
_FORMATS = {"csv": "csv", "tensorboard": "tensorboard"}
_NORM_SERIES = (("activations", "actv"), ("weight_grads", "grad_unreduced"), ("optimizer_states", "exp_avg"))


def translate_msprobe(path: Path) -> dict[str, Any]:
    """Read a msprobe monitor config and map it to trainmon's schema.

    Keys with a trainmon equivalent are mapped; a key that cannot be honoured (or an unknown
    key) is warned about once and ignored, so switching from msprobe is one line.

    Raises:
        ConfigError: the file cannot be read, is not UTF-8 JSON, repeats a key, is not a JSON
            object, or a key's value has the wrong type; the message names the file and the key.
    """
    data = parse_json(read_text(path, "msprobe config"), path)
    if not isinstance(data, dict):
        raise ConfigError(str(path), "a msprobe monitor config must be a JSON object")
    _check_types(data, path)
    out: dict[str, Any] = {
        # msprobe collects a family only when its switch is set; trainmon's defaults differ.
        "activations": {"enabled": False},
        "weight_grads": {"enabled": False},
        "optimizer_states": {"enabled": False},
        "params": {"enabled": False},
    }
    ops = [_OPS[op] for op in data.get("ops", []) if op in _OPS]
    for op in data.get("ops", []):
        if op not in _OPS:
            _cannot(f"ops: {op!r}", f"supported ops are {sorted(_OPS)} (plus infs)")
    metrics = {"metrics": ops} if ops else {}

    def section(name: str, **values: Any) -> None:
        out.setdefault(name, {}).update(values, **metrics)

    for key, value in data.items():
        if key == "targets":
            modules = [name for name in value] if isinstance(value, dict) else []
            if modules:
                out["targets"] = {"modules": modules}
        elif key == "xy_distribution":
            section("activations", enabled=bool(value))
        elif key == "all_xy":
            out["activations"]["inputs"] = bool(value)
        elif key == "forward_only" and value:
            out["activations"]["backward"] = False
        elif key == "backward_only" and value:
            out["activations"]["forward"] = False
        elif key == "wg_distribution":
            section("weight_grads", enabled=bool(value))
        elif key == "mv_distribution":
            section("optimizer_states", enabled=bool(value))
        elif key == "param_distribution":
            section("params", enabled=bool(value))
        elif key == "mg_direction":
            out["grad_probe"] = {"enabled": bool(value), "level": "L1"}
        elif key == "cc_distribution":
            section("communication", **_communication(value))
        elif key == "alert":
            continue  # after the loop: its series depend on which families are on
        elif key == "format":
            if value in _FORMATS:
                out["sinks"] = [_FORMATS[value]]
            else:
                _cannot(f"format: {value!r}", "trainmon writes csv and tensorboard")
        elif key == "eps":
            out["eps"] = value
        elif key in ("start_step", "step_interval", "collect_times", "print_struct"):
            out[key] = value
        elif key == "module_ranks":
            out["ranks"] = list(value) or None
        elif key == "ops":
            continue
        elif key in ("ndigits", "step_count_per_record"):
            _cannot(key, "trainmon writes full precision into one CSV per family")
        elif key in ("forward_only", "backward_only"):
            continue
        else:
            _cannot(key, "no trainmon equivalent")
    if "alert" in data:
        out["anomaly"] = _alert(data["alert"], out)
    return out


_LIST_OF = {"ops": str, "module_ranks": int}
"""msprobe keys whose value must be a list of this type."""


def _check_types(data: dict[str, Any], path: Path) -> None:
    """Reject the value types the translation cannot read (the rest is checked by trainmon's schema)."""

    def bad(key: str, what: str, value: Any) -> ConfigError:
        return ConfigError(str(path), f"msprobe key {key}: must be {what}, got {str(value)[:60]!r}")

    for key, kind in _LIST_OF.items():
        value = data.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
            raise bad(key, f"a list of {'strings' if kind is str else 'integers'}", value)
    for key in ("targets", "alert"):
        if key in data and not isinstance(data[key], dict):
            raise bad(key, "a JSON object", data[key])
    if "format" in data and not isinstance(data["format"], str):
        raise bad("format", "a string", data["format"])
    cc = data.get("cc_distribution", {})
    if not isinstance(cc, (dict, bool)):
        raise bad("cc_distribution", "a JSON object or true/false", cc)
    codelines = cc.get("cc_codeline", []) if isinstance(cc, dict) else []
    if not isinstance(codelines, list) or not all(isinstance(line, str) for line in codelines):
        raise bad("cc_distribution.cc_codeline", "a list of strings", codelines)
    rules = data.get("alert", {}).get("rules", [])
    if not isinstance(rules, list) or not all(isinstance(rule, dict) for rule in rules):
        raise bad("alert.rules", "a list of JSON objects", rules)
    for i, rule in enumerate(rules):
        args = rule.get("args", {})
        if not isinstance(args, dict):
            raise bad(f"alert.rules[{i}].args", "a JSON object", args)
        threshold = args.get("threshold", 0.5)
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise bad(f"alert.rules[{i}].args.threshold", "a number", threshold)


def _communication(value: Any) -> dict[str, Any]:
    """``cc_distribution``: ``enable``, ``cc_codeline`` (call-site filter); the rest is warned about."""
    if not isinstance(value, dict):
        return {"enabled": bool(value)}
    section: dict[str, Any] = {"enabled": bool(value.get("enable"))}
    for key, item in value.items():
        if key == "enable":
            continue
        if key == "cc_codeline":
            if item:  # msprobe's "path/file.py[line]" -> a regex on trainmon's "path/file.py:line in function"
                section["call_sites"] = True
                section["call_site_filter"] = "|".join(_codeline_regex(str(line)) for line in item)
        elif key == "cc_pre_hook":
            continue  # trainmon always measures both the inputs (pre) and the outputs (post)
        else:
            _cannot(f"cc_distribution.{key}", "no trainmon equivalent")
    return section


def _codeline_regex(codeline: str) -> str:
    match = re.fullmatch(r"(.*)\[(\d+)\]", codeline.strip())
    if match is None:
        return re.escape(codeline)
    return f"{re.escape(match.group(1))}:{match.group(2)} "


def _alert(value: Any, out: dict[str, Any]) -> dict[str, Any]:
    detectors: list[dict[str, Any]] = [{"type": "nonfinite"}]
    actions = ["log", "jsonl"]
    if not isinstance(value, dict):
        return {"detectors": detectors, "actions": actions}
    for rule in value.get("rules", []):
        if rule.get("rule_name") == "AnomalyTurbulence":
            threshold = rule.get("args", {}).get("threshold", 0.5)
            # msprobe applies the rule to the statistics of every monitored tensor: here, their norms.
            series = ["loss", "grad_norm"] + [f"{family}/*/norm" for section, family in _NORM_SERIES
                                              if out.get(section, {}).get("enabled")]
            detectors.append({"type": "spike", "method": "relative", "threshold": threshold, "series": series})
        else:
            _cannot(f"alert.rules: {rule.get('rule_name')!r}", "only AnomalyTurbulence is translated")
    if value.get("dump"):
        actions.append("dump")
        out["dump"] = {"enabled": True}
    return {"detectors": detectors, "actions": actions}


def _cannot(key: str, why: str) -> None:
    logger.warning("trainmon: msprobe config key %s is not honoured (%s)", key, why)
