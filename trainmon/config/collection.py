"""The config sections of what is collected: targets, activations, weight gradients, optimizer states,
parameters, communication and the grad probe (re-exported by :mod:`trainmon.config`)."""

from __future__ import annotations

from dataclasses import dataclass

from trainmon.base.schema import setting
from trainmon.base.targets import check_pattern
from trainmon.config.fields import metric_list, pattern_list
from trainmon.errors import ConfigError

__all__ = ["COMM_OPS", "GRAD_HOOKS", "OPTIMIZER_STATES", "PROBE_LEVELS", "PROBE_SCALARS", "ActivationsConfig",
           "CommunicationConfig", "GradProbeConfig", "OptimizerStatesConfig", "ParamsConfig", "TargetsConfig",
           "WeightGradsConfig"]

OPTIMIZER_STATES: tuple[str, ...] = ("exp_avg", "exp_avg_sq", "update", "ratio", "momentum")
COMM_OPS: tuple[str, ...] = (
    "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_single", "all_gather_into_tensor",
    "_all_gather_base", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base",
    "all_to_all", "all_to_all_single",
    "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)
"""``torch.distributed`` functions the communication collector can wrap."""
GRAD_HOOKS: tuple[str, ...] = ("module", "tensor")
PROBE_LEVELS: tuple[str, ...] = ("L0", "L1", "L2")
PROBE_SCALARS: tuple[str, ...] = ("none", "global", "param")


def _regex(value: str, path: str) -> None:
    check_pattern("re:" + value, path)


def _increasing(bounds: list[float], path: str) -> None:
    if bounds != sorted(set(bounds)):
        raise ConfigError(path, f"must be strictly increasing, got {bounds}")


@dataclass
class TargetsConfig:
    """Which modules and parameters are monitored."""

    modules: list[str] = pattern_list(["*"])
    """Module names: exact (``layers.0.mlp``), glob (``layers.*.mlp``) or regex (``re:^layers\\.[01]\\.``).
    A pattern that matches nothing fails at ``attach``, unless prefixed with ``optional:``
    (``optional:re:^layers\\.0\\.``). Patterns match submodules, not the model itself (see
    ``activations.root``); a model without submodules (one ``nn.Linear``) is selected by the default ``*``."""
    params: list[str] = pattern_list(["*"])
    """Parameter names, same pattern forms as ``modules``."""


@dataclass
class ActivationsConfig:
    """Forward inputs/outputs of target modules and the gradients w.r.t. them."""

    enabled: bool = False
    """Collect activations (family ``actv``) and activation gradients (``actv_grad``)."""
    metrics: list[str] = metric_list()
    """Statistics per tensor, any of norm, min, max, mean, zeros, nans, infs."""
    forward: bool = True
    """Measure forward inputs and outputs (msprobe ``backward_only: true`` turns this off)."""
    backward: bool = True
    """Measure gradients w.r.t. module inputs and outputs (how: ``grad_hooks``)."""
    inputs: bool = True
    """Measure module inputs as well as outputs (msprobe ``all_xy``)."""
    grad_hooks: str = setting("module", choices=GRAD_HOOKS)
    """How gradients are hooked: ``module`` (full backward hooks; ``input_grad`` is the gradient w.r.t. the
    module's inputs through this module only) or ``tensor`` (hooks on the output and input tensors;
    ``input_grad`` is the gradient of the input tensor summed over all its consumers, none for leaf tensors).
    Use ``tensor`` when a target's output or input is modified in place (``nn.ReLU(inplace=True)`` after a
    target, ``out += x``): torch rejects that under full backward hooks. ``module`` switches to ``tensor`` by
    itself, with a warning, when a target module has ``inplace=True``. MindSpore always uses cell backward
    hooks."""
    root: bool = False
    """Also measure the root module (the model given to ``attach``, each chunk of a pipeline): the model's own
    inputs and outputs and their gradients, in rows named ``.input``, ``.output``, ``.input_grad``, ``.output_grad``
    (the root's name is ``""``). Target patterns never select the root; msprobe's ``all_xy`` and ``""`` target
    set this."""
    group_mb: float = setting(256.0, minimum=0)
    """On the device path (GPU, Ascend, low-precision tensors), activations are kept by their hooks and measured
    together, a few kernels per group, when the root module's forward or a backward pass ends, or once the kept
    tensors reach this many MiB (the most memory they keep alive beyond what autograd keeps). 0 measures each
    tensor in its hook (one kernel call each). A row whose tensor the model modifies in place after the hook is
    measured in its hook (learned on its first collected step)."""


@dataclass
class WeightGradsConfig:
    """Gradients of the target parameters."""

    enabled: bool = True
    """Collect weight gradients."""
    metrics: list[str] = metric_list()
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
    states: list[str] = setting(["exp_avg", "exp_avg_sq", "update", "ratio", "momentum"], choices=OPTIMIZER_STATES,
                                unique=True)
    """Any of exp_avg, exp_avg_sq, update (m_hat / (sqrt(v_hat) + eps)), ratio (update / param), momentum (SGD).
    Each is written for the optimizers that keep it: Adam's moments for Adam, ``momentum`` (the optimizer's
    ``momentum_buffer``: SGD, RMSprop with momentum) for those; update and ratio are not
    written for NAdam and RAdam (not Adam's update; one warning); an optimizer keeping none of these (Adadelta,
    Adagrad, LBFGS) gets no rows, with one warning (docs/training_loops.md)."""
    metrics: list[str] = metric_list()
    """Statistics per state tensor."""
    precursors: bool = False
    """Family ``precursors``: per Adam parameter, from one read of its gradient, moments and weights after the
    step (docs/precursors.md): ``update_weight_ratio`` (lr * |update| / |param|), ``g2_v_rms`` and ``g2_v_max``
    (the root mean and the max over elements of g^2 / max(v_hat, eps^2): the stale second moment of
    StableAdamW), ``eps_underflow`` (the fraction of elements with sqrt(v_hat) < eps), ``cos_update_grad`` and
    ``cos_m_g``. Exact under sharding (FSDP2, DeepSpeed ZeRO, Megatron's distributed optimizer); SGD parameters
    have none. Series for the ``spike`` detector: ``precursors/{name}/{metric}``."""


@dataclass
class ParamsConfig:
    """Parameters themselves, read before the optimizer step (family ``param``)."""

    enabled: bool = False
    """Collect parameter statistics."""
    metrics: list[str] = metric_list()
    """Statistics per parameter."""


@dataclass
class CommunicationConfig:
    """Tensors passing through ``torch.distributed`` collectives (family ``comm``)."""

    enabled: bool = False
    """Wrap the collectives while attached and measure their inputs and outputs."""
    metrics: list[str] = metric_list()
    """Statistics per communicated tensor."""
    ops: list[str] = setting([], choices=COMM_OPS, unique=True)
    """``torch.distributed`` functions to wrap (e.g. all_reduce, reduce_scatter_tensor); empty means all supported."""
    call_sites: bool = False
    """Add the Python call site (``file:function:line``) of each collective to the row name."""
    call_site_filter: str | None = setting(None, check=_regex)
    """Regex searched in ``path/file.py:line in function``; only matching calls are measured."""


@dataclass
class GradProbeConfig:
    """Gradient distributions and direction similarity (``rank{R}/grad_probe/``; the run store with ``parquet``)."""

    enabled: bool = False
    """Run the grad probe on collected steps."""
    level: str = setting("L1", choices=PROBE_LEVELS)
    """L0: max, min, norm, shape, hash; L1: plus direction data; L2: plus interval fractions."""
    bounds: list[float] = setting([-1.0, 0.0, 1.0], check=_increasing)
    """Increasing interval bounds for L2 histograms."""
    sample_elements: int | None = setting(None, minimum=1)
    """Direction bits of at most this many elements per parameter (a fixed stratified subset); null: all.
    Also enables ``cos_prev`` (cosine with the previous collected step's sampled gradient)."""
    scalars: str = setting("global", choices=PROBE_SCALARS)
    """In-run similarities also sent as scalars (for anomaly detectors, TensorBoard): none;
    global (``grad_probe/{metric}`` over all target parameters); param (also ``grad_probe/{name}/{metric}``)."""
    mg_direction: bool = False
    """msprobe's ``mg_direction`` at every level: per parameter, the mean over elements of
    ``(1 + sign(g) * sign(exp_avg)) / 2`` (a zero sign counts one half) against ``exp_avg`` as the step
    finds it; 1.0 at step 0 (no momentum yet). Sent as the scalars ``grad_probe/mg_direction``
    (element-weighted over the target parameters) and, with ``scalars: param``, ``grad_probe/{name}/mg_direction``."""
