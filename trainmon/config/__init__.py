"""Typed monitor configuration, loaded from YAML, JSON, a dict or a :class:`MonitorConfig`.

Each section is a dataclass with a docstring per field; each field's rules (choices, range, a check of
its own) sit in its :func:`~trainmon.base.schema.setting`, and :mod:`trainmon.base.schema` applies them. Unknown
keys, wrong types and out-of-range values fail at construction with the dotted key and what is allowed.
``docs/config.md`` is generated from these docstrings (``python -m trainmon.config > docs/config.md``).

The sections live by theme: :mod:`.collection` (what is collected), :mod:`.features` (model features),
:mod:`.anomaly` (detectors, guard, rollback, dump, free benchmark), :mod:`.monitor` (:class:`MonitorConfig`, its
run-level fields, ``tensorboard`` and ``dynamic``); this package re-exports them and loads a config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainmon.base.precursors import PRECURSOR_METRICS, PRECURSORS
from trainmon.base.records import FEATURE_METRICS
from trainmon.base.schema import load
from trainmon.config import reference
from trainmon.config.anomaly import (
    ACTIONS,
    DUMP_MODES,
    FIXING_PERT_MODES,
    HANDLERS,
    MAX_DUMP_DEPTH,
    MAX_GUARD_WINDOW,
    PERT_MODES,
    ROLLBACK_DETECTORS,
    AnomalyConfig,
    DumpConfig,
    FreeBenchmarkConfig,
    GuardConfig,
    RollbackConfig,
)
from trainmon.config.collection import (
    COMM_OPS,
    GRAD_HOOKS,
    OPTIMIZER_STATES,
    PROBE_LEVELS,
    PROBE_SCALARS,
    ActivationsConfig,
    CommunicationConfig,
    GradProbeConfig,
    OptimizerStatesConfig,
    ParamsConfig,
    TargetsConfig,
    WeightGradsConfig,
)
from trainmon.config.features import (
    ATTENTION_LAYOUTS,
    AttentionFeaturesConfig,
    FeaturesConfig,
    RouterFeaturesConfig,
    WeightFeaturesConfig,
)
from trainmon.config.files import read_config_file
from trainmon.config.monitor import (
    ABSENT_RANKS,
    SINKS,
    DynamicConfig,
    MonitorConfig,
    TensorBoardConfig,
    check_ranks,
)
from trainmon.errors import ConfigError

__all__ = [
    "ABSENT_RANKS", "ACTIONS", "ATTENTION_LAYOUTS", "COMM_OPS", "DUMP_MODES", "FIXING_PERT_MODES", "GRAD_HOOKS",
    "HANDLERS", "MAX_DUMP_DEPTH", "MAX_GUARD_WINDOW", "OPTIMIZER_STATES", "PERT_MODES", "PROBE_LEVELS",
    "PROBE_SCALARS", "ROLLBACK_DETECTORS", "SINKS", "ActivationsConfig", "AnomalyConfig", "AttentionFeaturesConfig",
    "CommunicationConfig", "ConfigError", "DumpConfig", "DynamicConfig", "FeaturesConfig", "FreeBenchmarkConfig",
    "GradProbeConfig", "GuardConfig", "MonitorConfig", "OptimizerStatesConfig", "ParamsConfig", "RollbackConfig",
    "RouterFeaturesConfig", "TargetsConfig", "TensorBoardConfig", "WeightFeaturesConfig", "WeightGradsConfig",
    "check_ranks", "config_reference", "family_metrics", "load_config",
]


def load_config(source: MonitorConfig | Mapping[str, Any] | str | Path | None) -> MonitorConfig:
    """Build a validated :class:`MonitorConfig`.

    Args:
        source: a config object, a dict, a path to a ``.yaml``/``.yml``/``.json`` file, or None
            for the defaults.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or out-of-range value; the
            message names the dotted key (or the file) and what is allowed.

    Example:
        >>> load_config({"step_interval": 10}).step_interval
        10
    """
    if source is None:
        return load(MonitorConfig, {})
    if isinstance(source, MonitorConfig):
        return load(MonitorConfig, dataclasses.asdict(source))
    if isinstance(source, (str, Path)):
        return load(MonitorConfig, read_config_file(Path(source)))
    if isinstance(source, Mapping):
        return load(MonitorConfig, source)
    raise TypeError(f"config must be a MonitorConfig, a dict or a path, got {type(source).__name__}")


def config_reference() -> str:
    """docs/config.md: every section and field of :class:`MonitorConfig` (:func:`.reference.reference`)."""
    return reference.reference(MonitorConfig, "python -m trainmon.config > docs/config.md")


def family_metrics(config: MonitorConfig) -> dict[str, list[str]]:
    """``family -> metrics`` for every family the config turns on."""
    out: dict[str, list[str]] = {}
    a, w = config.activations, config.weight_grads
    if a.enabled and a.forward:
        out["actv"] = a.metrics
    if a.enabled and a.backward:
        out["actv_grad"] = a.metrics
    if w.enabled and w.unreduced:
        out["grad_unreduced"] = w.metrics
    if w.enabled and w.reduced:
        out["grad_reduced"] = w.metrics
    if config.optimizer_states.enabled:
        for state in config.optimizer_states.states:
            out[state] = config.optimizer_states.metrics
        if config.optimizer_states.precursors:
            out[PRECURSORS] = list(PRECURSOR_METRICS)
    if config.params.enabled:
        out["param"] = config.params.metrics
    if config.communication.enabled:
        out["comm"] = config.communication.metrics
    features = config.features
    for family, on in (("attn", features.attention.enabled), ("weight_features", features.weights.enabled),
                       ("router", features.router.enabled), ("expert_load", features.router.enabled)):
        if on:
            out[family] = list(FEATURE_METRICS[family])
    return {family: list(metrics) for family, metrics in out.items()}

