"""Typed monitor configuration, loaded from YAML, JSON, a dict or a :class:`MonitorConfig`.

Each section is a dataclass with a docstring per field. Unknown keys, wrong types and
out-of-range values fail at construction with the dotted key and what is allowed.
``docs/config.md`` is generated from these docstrings (``python -m trainmon.config``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from trainmon.errors import ConfigError
from trainmon.records import METRICS

INT64_MAX = 2**63 - 1

DEFAULT_METRICS: list[str] = list(METRICS)
SINKS: tuple[str, ...] = ("csv", "tensorboard")
OPTIMIZER_STATES: tuple[str, ...] = ("exp_avg", "exp_avg_sq", "update", "ratio", "momentum")
ACTIONS: tuple[str, ...] = ("log", "jsonl", "callback", "raise", "dump", "free_benchmark")
COMM_OPS: tuple[str, ...] = (
    "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_single", "all_gather_into_tensor",
    "_all_gather_base", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base",
    "all_to_all", "all_to_all_single",
    "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)
"""``torch.distributed`` functions the communication collector can wrap."""


def _metrics() -> list[str]:
    return list(DEFAULT_METRICS)


@dataclass
class TargetsConfig:
    """Which modules and parameters are monitored."""

    modules: list[str] = field(default_factory=lambda: ["*"])
    """Module names: exact (``layers.0.mlp``), glob (``layers.*.mlp``) or regex (``re:^layers\\.[01]\\.``). A pattern that matches nothing fails at ``attach``, unless prefixed with ``optional:`` (``optional:re:^layers\\.0\\.``)."""
    params: list[str] = field(default_factory=lambda: ["*"])
    """Parameter names, same pattern forms as ``modules``."""


@dataclass
class ActivationsConfig:
    """Forward inputs/outputs of target modules and the gradients w.r.t. them."""

    enabled: bool = False
    """Collect activations (family ``actv``) and activation gradients (``actv_grad``)."""
    metrics: list[str] = field(default_factory=_metrics)
    """Statistics per tensor, any of norm, min, max, mean, zeros, nans, infs."""
    forward: bool = True
    """Measure forward inputs and outputs (msprobe ``backward_only: true`` turns this off)."""
    backward: bool = True
    """Measure gradients w.r.t. module inputs and outputs (how: ``grad_hooks``)."""
    inputs: bool = True
    """Measure module inputs as well as outputs (msprobe ``all_xy``)."""
    grad_hooks: str = "module"
    """How gradients are hooked: ``module`` (full backward hooks; ``input_grad`` is the gradient w.r.t. the module's inputs through this module only) or ``tensor`` (hooks on the output and input tensors; ``input_grad`` is the gradient of the input tensor summed over all its consumers, none for leaf tensors). Use ``tensor`` when a target's output or input is modified in place (``nn.ReLU(inplace=True)`` after a target, ``out += x``): torch rejects that under full backward hooks. ``module`` switches to ``tensor`` by itself, with a warning, when a target module has ``inplace=True``. MindSpore always uses cell backward hooks."""


@dataclass
class WeightGradsConfig:
    """Gradients of the target parameters."""

    enabled: bool = True
    """Collect weight gradients."""
    metrics: list[str] = field(default_factory=_metrics)
    """Statistics per gradient."""
    unreduced: bool = True
    """Family ``grad_unreduced``: the gradient as accumulated on the parameter, before any data-parallel reduction."""
    reduced: bool = True
    """Family ``grad_reduced``: the gradient the optimizer steps with."""
    per_micro_step: bool = False
    """Write ``grad_unreduced`` after every micro-step, not only after the last one of the step."""


@dataclass
class OptimizerStatesConfig:
    """Optimizer states of the target parameters, read after the optimizer step."""

    enabled: bool = True
    """Collect optimizer states."""
    states: list[str] = field(default_factory=lambda: ["exp_avg", "exp_avg_sq", "update", "ratio"])
    """Any of exp_avg, exp_avg_sq, update (m_hat / (sqrt(v_hat) + eps)), ratio (update / param), momentum (SGD)."""
    metrics: list[str] = field(default_factory=_metrics)
    """Statistics per state tensor."""


@dataclass
class ParamsConfig:
    """Parameters themselves, read before the optimizer step (family ``param``)."""

    enabled: bool = False
    """Collect parameter statistics."""
    metrics: list[str] = field(default_factory=_metrics)
    """Statistics per parameter."""


@dataclass
class CommunicationConfig:
    """Tensors passing through ``torch.distributed`` collectives (family ``comm``)."""

    enabled: bool = False
    """Wrap the collectives while attached and measure their inputs and outputs."""
    metrics: list[str] = field(default_factory=_metrics)
    """Statistics per communicated tensor."""
    ops: list[str] = field(default_factory=list)
    """``torch.distributed`` functions to wrap (e.g. all_reduce, reduce_scatter_tensor); empty means all supported."""
    call_sites: bool = False
    """Add the Python call site (``file:function:line``) of each collective to the row name."""
    call_site_filter: str | None = None
    """Regex searched in ``path/file.py:line in function``; only matching calls are measured."""


@dataclass
class GradProbeConfig:
    """Gradient distributions and direction similarity (``rank{R}/grad_probe/``)."""

    enabled: bool = False
    """Run the grad probe on collected steps."""
    level: str = "L1"
    """L0: max, min, norm, shape, hash; L1: plus direction data; L2: plus interval fractions."""
    bounds: list[float] = field(default_factory=lambda: [-1.0, 0.0, 1.0])
    """Increasing interval bounds for L2 histograms."""
    sample_elements: int | None = None
    """Direction bits of at most this many elements per parameter (a fixed stratified subset); null: all.
    Also enables ``cos_prev`` (cosine with the previous collected step's sampled gradient)."""
    scalars: str = "global"
    """In-run similarities also sent as scalars (for anomaly detectors, TensorBoard): none;
    global (``grad_probe/{metric}`` over all target parameters); param (also ``grad_probe/{name}/{metric}``)."""
    mg_direction: bool = False
    """msprobe's ``mg_direction`` at every level: per parameter, the mean over elements of
    ``(1 + sign(g) * sign(exp_avg)) / 2`` (a zero sign counts one half) against ``exp_avg`` as the step
    finds it; 1.0 at step 0 (no momentum yet). Sent as the scalars ``grad_probe/mg_direction``
    (element-weighted over the target parameters) and, with ``scalars: param``, ``grad_probe/{name}/mg_direction``."""


@dataclass
class AnomalyConfig:
    """Anomaly detectors and what happens when they fire."""

    detectors: list[dict[str, Any]] = field(default_factory=lambda: [
        {"type": "nonfinite"}, {"type": "loss_spike"},
        {"type": "spike", "series": ["grad_reduced/*/norm"], "method": "log", "persist": 3}])
    """Detector specs, each ``{type: nonfinite|spike|loss_spike, ...}``; see docs/anomaly.md. The default
    third one is the per-layer gradient early warning (it fires a median 13 steps before the loss on the
    benchmark's layer blow-ups, with no false alarm in 108,000 healthy steps)."""
    actions: list[str] = field(default_factory=lambda: ["log", "jsonl"])
    """Any of log, jsonl, callback, raise, dump, free_benchmark."""
    log_limit: int = 10
    """At most this many log lines per step (the rest are summarised)."""


@dataclass
class DumpConfig:
    """Targeted tensor dump of the modules implicated by an anomaly."""

    enabled: bool = False
    """Allow dumps (as the ``dump`` action or through ``monitor.dump``)."""
    mode: str = "statistics"
    """statistics, tensor or md5."""
    depth: int = 1
    """Also dump the parent and children this many levels around the implicated module (at most 64)."""
    max_bytes: int = 1 << 30
    """Byte budget of one dump."""
    max_dumps: int = 3
    """Dumps per run."""
    stack: bool = True
    """Write ``stack.json``: the Python call stack of each dumped forward call."""


@dataclass
class FreeBenchmarkConfig:
    """Perturbation checks of a module's forward."""

    enabled: bool = False
    """Allow free-benchmark checks (as the ``free_benchmark`` action or by hand)."""
    pert_mode: str = "improve_precision"
    """improve_precision, add_noise, bit_noise, change_value, no_change or to_cpu."""
    handler: str = "check"
    """check: compare and write failures to ``free_benchmark.csv``; fix: also replace the module's
    output by the improve_precision / to_cpu result (value only; gradients flow through the original)."""
    targets: list[str] = field(default_factory=list)
    """Modules checked every ``interval`` steps (exact names, globs or ``re:`` regexes); empty: only on anomaly or by hand."""
    interval: int = 1
    """Check ``targets`` on every N-th step."""
    max_per_step: int = 4
    """At most this many modules are re-run per step (a whole network is never re-run by accident)."""


@dataclass
class DynamicConfig:
    """Re-reading the config file while training."""

    watch: bool = False
    """Re-read the config file when it changes; the new config applies from the next step."""
    poll_seconds: float = 5.0
    """Check the file's modification time at most this often."""


@dataclass
class MonitorConfig:
    """The whole monitor configuration; every key is optional."""

    enabled: bool = True
    """Master switch; ``false`` makes every step uncollected."""
    output_dir: str = "./trainmon_output"
    """Directory that receives ``{run_name}/``."""
    run_name: str | None = None
    """Run directory name; default a UTC timestamp (shared by all ranks)."""
    sinks: list[str] = field(default_factory=lambda: ["csv", "tensorboard"])
    """Outputs: csv, tensorboard."""
    ranks: list[int] | None = None
    """Ranks that collect and write (distinct, each below the world size: checked at ``attach``); null means every rank."""
    start_step: int = 0
    """First step that is collected."""
    step_interval: int = 1
    """Collect every N-th step from ``start_step``."""
    collect_times: int | None = None
    """Stop after this many collected steps; null means no limit."""
    eps: float = 1e-8
    """``zeros`` counts elements with ``|x| < eps``."""
    flush_seconds: float = 2.0
    """Outputs flush as soon as their writer is idle, and at least this often while it is busy (and on close)."""
    targets: TargetsConfig = field(default_factory=TargetsConfig)
    """Module and parameter selection."""
    activations: ActivationsConfig = field(default_factory=ActivationsConfig)
    """Activation statistics."""
    weight_grads: WeightGradsConfig = field(default_factory=WeightGradsConfig)
    """Weight-gradient statistics."""
    optimizer_states: OptimizerStatesConfig = field(default_factory=OptimizerStatesConfig)
    """Optimizer-state statistics."""
    params: ParamsConfig = field(default_factory=ParamsConfig)
    """Parameter statistics."""
    communication: CommunicationConfig = field(default_factory=CommunicationConfig)
    """Collective-communication statistics."""
    grad_probe: GradProbeConfig = field(default_factory=GradProbeConfig)
    """Grad probe."""
    anomaly: AnomalyConfig = field(default_factory=AnomalyConfig)
    """Anomaly detection."""
    dump: DumpConfig = field(default_factory=DumpConfig)
    """Dump on anomaly."""
    free_benchmark: FreeBenchmarkConfig = field(default_factory=FreeBenchmarkConfig)
    """Free benchmark."""
    dynamic: DynamicConfig = field(default_factory=DynamicConfig)
    """Dynamic reconfiguration."""
    print_struct: bool = False
    """Write ``module_struct.json`` (module tree with input/output shapes of the first step)."""


# --------------------------------------------------------------------------- validation rules
_CHOICES: dict[str, tuple[Any, ...]] = {
    "sinks": SINKS,
    "activations.metrics": METRICS, "activations.grad_hooks": ("module", "tensor"), "weight_grads.metrics": METRICS,
    "optimizer_states.metrics": METRICS, "params.metrics": METRICS, "communication.metrics": METRICS,
    "communication.ops": COMM_OPS,
    "optimizer_states.states": OPTIMIZER_STATES,
    "grad_probe.level": ("L0", "L1", "L2"),
    "grad_probe.scalars": ("none", "global", "param"),
    "anomaly.actions": ACTIONS,
    "dump.mode": ("statistics", "tensor", "md5"),
    "free_benchmark.pert_mode": ("improve_precision", "add_noise", "bit_noise", "change_value", "no_change", "to_cpu"),
    "free_benchmark.handler": ("check", "fix"),
}
_MAXIMUM: dict[str, float] = {
    "dump.depth": 64,  # deeper than any module tree; a huge value would stall every anomalous step
}
_UNIQUE = ("ranks",)
"""Lists without choices that must not repeat an item."""
_MINIMUM: dict[str, float] = {
    "start_step": 0, "step_interval": 1, "collect_times": 1, "eps": 0.0,
    "dump.depth": 0, "dump.max_bytes": 1, "dump.max_dumps": 1, "dynamic.poll_seconds": 0.0,
    "grad_probe.sample_elements": 1, "anomaly.log_limit": 1, "ranks[]": 0,
    "free_benchmark.interval": 1, "free_benchmark.max_per_step": 1,
}


def type_name(tp: Any) -> str:
    """A readable name for a type annotation (error messages, docs/config.md)."""
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def convert_value(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (dataclasses built).

    Raises:
        ConfigError: the value does not fit; the message names ``path``.
    """
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(path, "must not be null")
        (inner,) = [a for a in args if a is not type(None)]
        return convert_value(value, inner, path)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            value = dataclasses.asdict(value)
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"must be a mapping with keys {sorted(f.name for f in dataclasses.fields(tp))}")
        return _build(tp, value, path)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"must be a list, got {type(value).__name__}")
        (inner,) = typing.get_args(tp)
        return [convert_value(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"must be a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be true or false, got {_short(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"must be an integer, got {_short(value)}")
        if not -INT64_MAX <= value <= INT64_MAX:
            raise ConfigError(path, f"must be an integer of at most 19 digits (|x| <= 2**63-1), got {_short(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(path, f"must be a finite number, got {_short(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"must be a string, got {_short(value)}")
        if "\0" in value:
            raise ConfigError(path, "must not contain a NUL character")
        return value
    raise AssertionError(f"unsupported annotation {type_name(tp)} at {path}")  # pragma: no cover


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (a 10,000-digit number or a huge list stays one short line)."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # ints beyond the digit limit, self-referencing lists
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def _check(path: str, value: Any) -> None:
    rule_path = path.split("[")[0]
    items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]

    def where(i: int | None) -> str:
        return path if i is None else f"{path}[{i}]"

    if rule_path in _CHOICES:
        allowed = _CHOICES[rule_path]
        for i, item in items:
            if item not in allowed:
                raise ConfigError(where(i), f"{item!r} is not allowed; choose from {list(allowed)}")
        if isinstance(value, list) and len(set(value)) != len(value):
            raise ConfigError(path, f"has duplicates: {value}")
    if rule_path in _UNIQUE and isinstance(value, list):
        seen: set[Any] = set()
        for i, item in items:
            if item in seen:
                raise ConfigError(where(i), f"{item!r} is listed twice")
            seen.add(item)
    key = rule_path + "[]" if isinstance(value, list) else rule_path
    if key in _MINIMUM and value is not None:
        for i, item in items:
            if item < _MINIMUM[key]:
                raise ConfigError(where(i), f"must be >= {_MINIMUM[key]:g}, got {item}")
    if key in _MAXIMUM and value is not None:
        for i, item in items:
            if item > _MAXIMUM[key]:
                raise ConfigError(where(i), f"must be <= {_MAXIMUM[key]:g}, got {_short(item)}")


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        name = key if isinstance(key, str) and key and key.strip() == key else repr(key)  # '' or ' x' quoted
        path = f"{prefix}.{name}" if prefix else name
        if key not in fields:
            raise ConfigError(path, f"unknown key; valid keys here: {sorted(fields)}")
        kwargs[key] = convert_value(value, hints[key], path)
        _check(path, kwargs[key])
    obj = cls(**kwargs)
    _cross_check(obj, prefix)
    return obj


def _cross_check(obj: Any, prefix: str) -> None:
    if isinstance(obj, CommunicationConfig) and obj.call_site_filter is not None:
        _check_pattern("re:" + obj.call_site_filter, f"{prefix}.call_site_filter")
    if isinstance(obj, GradProbeConfig) and obj.bounds != sorted(set(obj.bounds)):
        raise ConfigError(f"{prefix}.bounds", f"must be strictly increasing, got {obj.bounds}")
    if isinstance(obj, TargetsConfig):
        for kind in ("modules", "params"):
            for i, pattern in enumerate(getattr(obj, kind)):
                _check_pattern(pattern, f"{prefix}.{kind}[{i}]")
    if isinstance(obj, AnomalyConfig):
        from trainmon.anomaly.detectors import build_detectors  # validates type and fields

        build_detectors(obj.detectors, path=f"{prefix}.detectors")
    if isinstance(obj, FreeBenchmarkConfig):
        for i, pattern in enumerate(obj.targets):
            _check_pattern(pattern, f"{prefix}.targets[{i}]")
    if isinstance(obj, FreeBenchmarkConfig) and obj.handler == "fix" and obj.pert_mode not in (
            "improve_precision", "to_cpu"):
        raise ConfigError(f"{prefix}.handler", f"fix needs pert_mode improve_precision or to_cpu, got {obj.pert_mode!r}")
    if isinstance(obj, MonitorConfig):
        for action, section in (("dump", obj.dump), ("free_benchmark", obj.free_benchmark)):
            if action in obj.anomaly.actions and not section.enabled:
                raise ConfigError("anomaly.actions", f"{action!r} needs {action}.enabled: true")
    if isinstance(obj, MonitorConfig) and not 0 < obj.flush_seconds <= threading.TIMEOUT_MAX:
        raise ConfigError("flush_seconds", f"must be > 0 and <= {threading.TIMEOUT_MAX:g} (seconds), "
                                           f"got {obj.flush_seconds:g}")
    if isinstance(obj, MonitorConfig) and obj.ranks is not None and not obj.ranks:
        raise ConfigError("ranks", "must name at least one rank (null: every rank; enabled: false turns the monitor off)")
    if isinstance(obj, MonitorConfig) and obj.run_name is not None:
        if (not obj.run_name or "/" in obj.run_name or "\\" in obj.run_name or obj.run_name in (".", "..")
                or len(obj.run_name.encode()) > 255):
            raise ConfigError("run_name", f"must be a plain directory name (at most 255 bytes), got {_short(obj.run_name)}")


def _check_pattern(pattern: str, path: str) -> None:
    import re

    from trainmon.targets import OPTIONAL, split_optional

    if not pattern:
        raise ConfigError(path, "must not be empty")
    pattern, optional = split_optional(pattern)
    if optional and not pattern:
        raise ConfigError(path, f"must name a pattern after {OPTIONAL!r}")
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as exc:
            raise ConfigError(path, f"invalid regex {pattern[3:]!r}: {exc}") from None


def check_ranks(ranks: list[int] | None, world_size: int) -> None:
    """Check the config's ``ranks`` against the job's world size (called at ``attach``).

    Args:
        ranks: ``MonitorConfig.ranks`` (None: every rank).
        world_size: the number of ranks of the job.

    Raises:
        ConfigError: a listed rank does not exist (``ranks`` is named, with the valid range).

    Example:
        >>> check_ranks([0, 3], world_size=2)  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        ConfigError: ranks: rank 3 does not exist: this job has 2 ranks (0..1)
    """
    if ranks is None:
        return
    missing = [rank for rank in ranks if not 0 <= rank < world_size]
    if missing:
        listed = ", ".join(str(rank) for rank in missing[:10]) + (", ..." if len(missing) > 10 else "")
        raise ConfigError("ranks", f"rank{'s' if len(missing) > 1 else ''} {listed} "
                                   f"{'do' if len(missing) > 1 else 'does'} not exist: this job has {world_size} "
                                   f"rank{'s' if world_size != 1 else ''} (0..{world_size - 1})")


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
        return _build(MonitorConfig, {}, "")
    if isinstance(source, MonitorConfig):
        return _build(MonitorConfig, dataclasses.asdict(source), "")
    if isinstance(source, (str, Path)):
        return _build(MonitorConfig, read_config_file(Path(source)), "")
    if isinstance(source, Mapping):
        return _build(MonitorConfig, source, "")
    raise TypeError(f"config must be a MonitorConfig, a dict or a path, got {type(source).__name__}")


def read_config_file(path: Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into a dict (no validation).

    Raises:
        ConfigError: the file has another suffix, cannot be read (missing, a directory, a named
            pipe), is not UTF-8, cannot be parsed, is nested too deeply, repeats a key (the
            dotted key is named) or is not a mapping; the message names the file.
    """
    if path.suffix not in (".yaml", ".yml", ".json"):
        raise ConfigError(str(path), "config file must end in .yaml, .yml or .json")
    text = read_text(path, "config file")
    data = parse_json(text, path) if path.suffix == ".json" else parse_yaml(text, path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), f"top level must be a mapping, got {type(data).__name__}")
    return data


def read_text(path: Path, what: str) -> str:
    """The UTF-8 text of a regular file (a leading byte-order mark is dropped).

    Raises:
        ConfigError: unreadable, not a regular file (a named pipe is refused, never waited on) or
            not UTF-8; the key is the file.
    """
    from trainmon.inputs import read_regular

    try:
        data = read_regular(path)
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read {what}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


class _Pairs(list):  # type: ignore[type-arg]
    """A JSON object as its ``(key, value)`` pairs, so that repeated keys can be found."""


def parse_json(text: str, path: Path) -> Any:
    """Parse JSON config text; an empty text is None.

    Raises:
        ConfigError: invalid JSON, nested too deeply, or a repeated key (named by its dotted path).
    """
    if not text.strip():
        return None
    try:
        return _unique_keys(json.loads(text, object_pairs_hook=_Pairs), "", path)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(path), f"cannot parse: {exc}") from None
    except RecursionError:
        raise ConfigError(str(path), "cannot parse: nested too deeply") from None


def _unique_keys(value: Any, prefix: str, path: Path) -> Any:
    if isinstance(value, _Pairs):
        out: dict[str, Any] = {}
        for key, item in value:
            dotted = f"{prefix}.{key}" if prefix else key
            if key in out:
                raise ConfigError(dotted, f"key repeated in {path} (a mapping may give each key once)")
            out[key] = _unique_keys(item, dotted, path)
        return out
    if isinstance(value, list):
        return [_unique_keys(item, f"{prefix}[{i}]", path) for i, item in enumerate(value)]
    return value


def parse_yaml(text: str, path: Path) -> Any:
    """Parse YAML config text with the safe loader.

    Raises:
        ConfigError: invalid YAML, nested too deeply, or a repeated key (named by its dotted path,
            with both lines).
    """
    import yaml

    loader = None
    try:
        loader = yaml.SafeLoader(text)  # checks the characters already
        node = loader.get_single_node()
        if node is None:
            return None
        _check_yaml_keys(node, path)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), f"cannot parse: {exc}") from None
    except RecursionError:
        raise ConfigError(str(path), "cannot parse: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()


def _check_yaml_keys(root: Any, path: Path) -> None:
    """Raise for a key given twice in one mapping (PyYAML keeps the last one silently).

    Iterative, and each node is visited once: aliases (``*a``), even self-referencing ones or an
    exponential "billion laughs" document, cost one visit per distinct node.
    """
    import yaml

    stack: list[tuple[Any, str]] = [(root, "")]
    seen: set[int] = set()
    while stack:
        node, prefix = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{prefix}[{i}]") for i, item in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                if key.tag == "tag:yaml.org,2002:merge":  # `<<: *base` merges; its keys may be overridden
                    stack.append((value, prefix))
                    continue
                name = str(key.value) if isinstance(key, yaml.ScalarNode) else f"<{key.id}>"
                dotted = f"{prefix}.{name}" if prefix else name
                where = (key.tag, name)
                if where in first:
                    raise ConfigError(dotted, f"key repeated in {path} (lines {first[where] + 1} and "
                                              f"{key.start_mark.line + 1}; a mapping may give each key once)")
                first[where] = key.start_mark.line
                stack.append((value, dotted))


if __name__ == "__main__":  # pragma: no cover
    from trainmon.config_doc import config_reference

    print(config_reference())
