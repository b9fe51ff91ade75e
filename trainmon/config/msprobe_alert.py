"""msprobe's ``alert`` as trainmon's ``anomaly`` section (framework-free): ``AnomalyTurbulence`` becomes a relative
``spike`` detector on every monitored row, ``AnomalyNan`` the ``nonfinite`` detector, ``alert.dump`` the ``jsonl``
action."""

from __future__ import annotations

from typing import Any

from trainmon.config.msprobe_notes import MsprobeNotes

__all__ = ["translate_alert"]

_FAMILY_OF_SECTION = {"activations": ("actv", "actv_grad"), "weight_grads": ("grad_unreduced", "grad_reduced"),
                      "optimizer_states": (), "params": ("param",), "communication": ("comm",)}


def translate_alert(alert: dict[str, Any], out: dict[str, Any], notes: MsprobeNotes) -> dict[str, Any]:
    """The ``anomaly`` section of msprobe's ``alert`` (its rules, ``inform``, ``dump``), given the families that
    ``out`` (the translation so far) turns on."""
    detectors: list[dict[str, Any]] = [{"type": "nonfinite"}]
    for rule in alert.get("rules") or []:
        name = rule.get("rule_name")
        args = rule.get("args") or {}
        if name == "AnomalyTurbulence" and "threshold" in args:
            detectors.append({"type": "spike", "method": "relative", "threshold": float(args["threshold"]),
                              "series": _turbulence_series(out)})
        elif name == "AnomalyNan":
            if args.get("threshold") is not None:
                notes.cannot("alert.rules: AnomalyNan threshold", "trainmon has no |value| > threshold detector; "
                                                                  "its nonfinite detector reports NaN and Inf")
        else:
            notes.cannot(f"alert.rules: {str(name)[:40]!r}", "msprobe knows AnomalyTurbulence (with args."
                                                             "threshold) and AnomalyNan; msprobe skips it too")
    if alert.get("inform"):
        notes.cannot("alert.inform", "trainmon sends no database or e-mail message; register a function with "
                                     "monitor.on_anomaly and the callback action")
    actions = ["log", "jsonl"] if alert.get("dump") else ["log"]
    return {"detectors": detectors, "actions": actions}


def _turbulence_series(out: dict[str, Any]) -> list[str]:
    """msprobe 1.2.1 scans every value it writes (each row and each op) with AnomalyTurbulence."""
    metrics = out["activations"]["metrics"]
    families = [family for section, names in _FAMILY_OF_SECTION.items() if out.get(section, {}).get("enabled")
                for family in names]
    if out["activations"].get("enabled") and not out["activations"].get("forward", True):
        families.remove("actv")
    if out["activations"].get("enabled") and not out["activations"].get("backward", True):
        families.remove("actv_grad")
    if out["optimizer_states"]["enabled"]:  # msprobe draws the update as heatmaps, which it does not scan
        families += [state for state in out["optimizer_states"]["states"] if state != "update"]
    series = [f"{family}/*/{metric}" for family in families for metric in metrics]
    if out.get("grad_probe", {}).get("mg_direction"):
        series.append("grad_probe/*/mg_direction")
    return series or ["grad_norm"]
