"""Typed monitor configuration, loaded from YAML, JSON, a dict or a :class:`MonitorConfig`.

Each section is a dataclass with a docstring per field; each field's rules (choices, range, a check of
its own) sit in its :func:`~trainmon.base.schema.setting`, and :mod:`trainmon.base.schema` applies them. Unknown
keys, wrong types and out-of-range values fail at construction with the dotted key and what is allowed.
``docs/config.md`` is generated from these docstrings (``python -m trainmon.config > docs/config.md``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainmon.anomaly.detectors import DETECTORS, check_specs
from trainmon.anomaly.skips import DETECTOR as GUARD_DETECTOR
from trainmon.base.precursors import PRECURSOR_METRICS, PRECURSORS
from trainmon.base.records import FAMILIES, FEATURE_METRICS, METRICS, ROW_METRICS
from trainmon.base.schema import each, load, setting, short
from trainmon.base.targets import check_pattern, compile_pattern
from trainmon.config import reference
from trainmon.config.files import read_config_file
from trainmon.errors import ConfigError

__all__ = ["ConfigError", "MonitorConfig", "RollbackConfig", "check_ranks", "config_reference", "load_config"]

SINKS: tuple[str, ...] = ("csv", "tensorboard", "parquet")
OPTIMIZER_STATES: tuple[str, ...] = ("exp_avg", "exp_avg_sq", "update", "ratio", "momentum")
ACTIONS: tuple[str, ...] = ("log", "jsonl", "callback", "raise", "dump", "free_benchmark", "rollback")
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
DUMP_MODES: tuple[str, ...] = ("statistics", "tensor", "md5")
PERT_MODES: tuple[str, ...] = ("improve_precision", "add_noise", "bit_noise", "change_value", "no_change", "to_cpu")
FIXING_PERT_MODES: tuple[str, ...] = ("improve_precision", "to_cpu")
"""The perturbations whose result may replace a module's output (``free_benchmark.handler: fix``)."""
HANDLERS: tuple[str, ...] = ("check", "fix")
ABSENT_RANKS: tuple[str, ...] = ("error", "skip")
ATTENTION_LAYOUTS: tuple[str, ...] = ("sbhd", "bshd")
"""Layouts of a query or key tensor read from an attention module's inputs: sequence, batch, heads, head size."""
MAX_DUMP_DEPTH = 64
"""Deeper than any module tree; a huge ``dump.depth`` would stall every anomalous step."""


def _metrics() -> Any:
    """The ``metrics`` field of a section: any of :data:`~trainmon.base.records.METRICS`, each once; default all."""
    return setting(list(METRICS), choices=METRICS, unique=True)


def _patterns(default: list[str]) -> Any:
    """A list of name patterns (:mod:`trainmon.base.targets`), each checked at construction."""
    return setting(default, check=each(check_pattern))


def _regex(value: str, path: str) -> None:
    check_pattern("re:" + value, path)


def _tensor_pattern(value: str, path: str) -> None:
    compile_pattern(value, path)


def _increasing(bounds: list[float], path: str) -> None:
    if bounds != sorted(set(bounds)):
        raise ConfigError(path, f"must be strictly increasing, got {bounds}")


def _some_rank(ranks: list[int], path: str) -> None:
    if not ranks:
        raise ConfigError(path, "must name at least one rank (null: every rank; enabled: false turns the monitor off)")


def _directory_name(name: str, path: str) -> None:
    if not name or "/" in name or "\\" in name or name in (".", "..") or len(name.encode()) > 255:
        raise ConfigError(path, f"must be a plain directory name (at most 255 bytes), got {short(name)}")


def _timeout(seconds: float, path: str) -> None:
    if not 0 < seconds <= threading.TIMEOUT_MAX:
        raise ConfigError(path, f"must be > 0 and <= {threading.TIMEOUT_MAX:g} (seconds), got {seconds:g}")


@dataclass
class TargetsConfig:
    """Which modules and parameters are monitored."""

    modules: list[str] = _patterns(["*"])
    """Module names: exact (``layers.0.mlp``), glob (``layers.*.mlp``) or regex (``re:^layers\\.[01]\\.``).
    A pattern that matches nothing fails at ``attach``, unless prefixed with ``optional:``
    (``optional:re:^layers\\.0\\.``). Patterns match submodules, not the model itself (see
    ``activations.root``); a model without submodules (one ``nn.Linear``) is selected by the default ``*``."""
    params: list[str] = _patterns(["*"])
    """Parameter names, same pattern forms as ``modules``."""


@dataclass
class ActivationsConfig:
    """Forward inputs/outputs of target modules and the gradients w.r.t. them."""

    enabled: bool = False
    """Collect activations (family ``actv``) and activation gradients (``actv_grad``)."""
    metrics: list[str] = _metrics()
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
    metrics: list[str] = _metrics()
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
    states: list[str] = setting(["exp_avg", "exp_avg_sq", "update", "ratio"], choices=OPTIMIZER_STATES, unique=True)
    """Any of exp_avg, exp_avg_sq, update (m_hat / (sqrt(v_hat) + eps)), ratio (update / param), momentum (SGD)."""
    metrics: list[str] = _metrics()
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
    metrics: list[str] = _metrics()
    """Statistics per parameter."""


@dataclass
class CommunicationConfig:
    """Tensors passing through ``torch.distributed`` collectives (family ``comm``)."""

    enabled: bool = False
    """Wrap the collectives while attached and measure their inputs and outputs."""
    metrics: list[str] = _metrics()
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


MAX_GUARD_WINDOW = 100_000
"""Longer than any useful history; the guard keeps ``window x (1 + parameters)`` floats on the device."""


@dataclass
class GuardConfig:
    """The step guard: a step whose gradients are poisoned is not applied (docs/actions.md, "Step guard").

    Checked on every step, before the optimizer applies the gradients (a torch optimizer's after unscaling and
    clipping; DeepSpeed and Megatron-Core clip after it); a skipped step leaves the parameters and the optimizer
    state (moments, step counts, master weights) as they were. torch, FSDP2, DeepSpeed and Megatron-Core (the last
    two skip through their own overflow paths); MindSpore and the set-ups a framework cannot skip exactly are
    refused at ``attach``."""

    enabled: bool = False
    """Check every step's gradients and skip the update when a rule below fires."""
    nonfinite: bool = True
    """Skip a step whose gradients hold a NaN or an Inf (under a ``GradScaler`` the scaler does this)."""
    max_grad_norm: float | None = setting(None, above=0.0)
    """Skip a step whose global gradient norm is above this; null: no absolute limit."""
    z_threshold: float | None = setting(6.0, above=0.0)
    """Skip a step whose global gradient norm is more than this many standard deviations above its mean over
    the applied steps among the last ``window`` (the deviation counts as at least 1% of the mean); null: off."""
    per_parameter: bool = False
    """Apply ``z_threshold`` to each parameter's gradient norm too, each against its own history."""
    window: int = setting(128, minimum=2, maximum=MAX_GUARD_WINDOW)
    """Steps whose gradient norms make the history (kept on the device; skipped steps leave a gap)."""
    warmup: int = setting(64, minimum=2)
    """Applied steps the history must hold before ``z_threshold`` may fire (at most ``window``)."""
    escalate_after: int | None = setting(5, minimum=1)
    """This many skipped steps in a row escalate (again at each further multiple); null: never."""
    escalate: list[str] = setting(["log", "jsonl", "raise"], choices=ACTIONS, unique=True)
    """Anomaly actions applied to the escalation event: any of log, jsonl, callback, raise, dump,
    free_benchmark, rollback (``raise``: :class:`~trainmon.errors.AnomalyError` at the end of the step;
    ``rollback``: the run stops with ``anomaly.rollback.exit_code``, docs/actions.md, "Rollback")."""

    def cross_check(self, path: str) -> None:
        """The warm-up fits in the window."""
        if self.warmup > self.window:
            raise ConfigError(f"{path}.warmup", f"must be <= window ({self.window}), got {self.warmup}")


ROLLBACK_DETECTORS: tuple[str, ...] = (*DETECTORS, GUARD_DETECTOR)
"""What ``anomaly.rollback.detectors`` may name: the detector types and the step guard."""


@dataclass
class RollbackConfig:
    """Healthy checkpoints, the skip list and the ``rollback`` action (docs/actions.md, "Rollback")."""

    detectors: list[str] = setting(["nonfinite", "loss_spike"], choices=ROLLBACK_DETECTORS, unique=True)
    """The detectors (by ``type``) whose events, at a step whose update was applied, make the training state
    unhealthy (``monitor.state_dict()['healthy']``), enter the skip list and trigger the ``rollback`` action;
    ``step_guard``: also every step the guard skipped triggers it (such a step enters the skip list anyway)."""
    exit_code: int = setting(17, minimum=3, maximum=125)
    """The exit status of a run the ``rollback`` action stops (``SystemExit``): what a launcher script tests to
    resume from the last healthy checkpoint (3 to 125: not success, an uncaught error, bad usage or a signal)."""
    skip_list: bool = True
    """Append the flagged and skipped steps, with the identity of their data, to ``{run}/rank{R}/skip_list.jsonl``."""


@dataclass
class AttentionFeaturesConfig:
    """Per-head attention features (family ``attn``; docs/features.md)."""

    enabled: bool = False
    """For every head of every attention module, on collected steps: the largest attention logit
    (``q.k * scale``, masked entries left out) and the mean softmax entropy (nats) over the sampled query rows,
    each scored against all keys; rows ``{module}.head{h}`` (global head index under tensor parallelism), columns
    ``max_logit``, ``entropy``."""
    query_rows: int = setting(64, minimum=1)
    """Query rows sampled per call of a module: spread evenly over the batch (at most this many sequences) and over
    the positions of each sequence, the same ones every step. The seq x seq matrix is never formed: only these rows'
    logits, ``query_rows x keys`` per head."""
    modules: list[str] = _patterns([])
    """The attention modules (exact names, globs or regexes, among all modules). Empty: every target module
    (``targets.modules``) whose class name ends in ``Attention`` and that holds no such module (HF's
    ``LlamaAttention``, nanoGPT's ``CausalSelfAttention``, Megatron-Core's core attention)."""
    inputs: str | None = setting(None, choices=ATTENTION_LAYOUTS)
    """Where query and key come from. null: from the attention function the module calls (torch's
    ``scaled_dot_product_attention``, with its mask, ``is_causal``, scale and grouped heads; or a softmax over
    ``[batch, heads, queries, keys]`` scores, as HF's eager attention computes them); Megatron-Core's core attention
    from its inputs. ``sbhd`` / ``bshd``: the module's first two positional inputs are the query and the key in this
    layout (msprobe's ``sa_order``), scaled by ``1/sqrt(head size)``, with the mask ``causal`` says."""
    causal: bool = True
    """With ``inputs``: a query sees the keys at or before its position only."""


@dataclass
class WeightFeaturesConfig:
    """Spectral features of the weight matrices (family ``weight_features``; docs/features.md)."""

    enabled: bool = False
    """For every 2-D target parameter, at the end of each collected step: the spectral norm ``sigma_1`` by power
    iteration on the device (a vector per matrix kept from one collected step to the next) and the stable rank
    ``||W||_F^2 / sigma_1^2``; rows named by the parameter, columns ``spectral_norm``, ``stable_rank``. Shards
    (tensor parallelism, FSDP2) are combined exactly: one all-reduce per iteration over their group."""
    iterations: int = setting(2, minimum=1, maximum=1000)
    """Power iterations per collected step, continuing from the previous step's vector (so the estimate, a lower
    bound of ``sigma_1``, converges over the collected steps and follows the weights as they change)."""
    params: list[str] = _patterns([])
    """The parameters measured, among the 2-D ones of the model: exact names, globs or regexes. Empty: the 2-D
    target parameters (``targets.params``)."""
    embeddings: bool = True
    """Measure embedding tables too (``nn.Embedding``, Megatron-Core's vocabulary-parallel embedding)."""


@dataclass
class RouterFeaturesConfig:
    """Mixture-of-experts router features (families ``router`` and ``expert_load``; docs/features.md)."""

    enabled: bool = False
    """For every router, per micro-step of a collected step, from its logits and its top-k choice: the load
    imbalance (max / mean tokens per expert), the mean entropy of the routing softmax per token, the z-loss (mean
    ``logsumexp(logits)^2``) and the mean pairwise cosine similarity of the experts' weights (family ``router``, row
    ``{router}``); the tokens routed to each expert and their share (family ``expert_load``, rows
    ``{router}.expert{e}``)."""
    modules: list[str] = _patterns([])
    """The router modules (exact names, globs or regexes, among all modules). Empty: every module whose class name
    ends in ``Router`` (HF's ``MixtralTopKRouter``, ``OlmoeTopKRouter``, ``Qwen2MoeTopKRouter``, ...; Megatron-Core's
    ``TopKRouter``)."""
    expert_similarity: bool = True
    """Compute ``expert_similarity`` (NaN when the experts' weights are not found next to the router)."""


@dataclass
class FeaturesConfig:
    """Model features computed on collected steps, on the device (docs/features.md)."""

    attention: AttentionFeaturesConfig = field(default_factory=AttentionFeaturesConfig)
    """Per-head attention logits and entropy."""
    weights: WeightFeaturesConfig = field(default_factory=WeightFeaturesConfig)
    """Spectral norm and stable rank of the weight matrices."""
    router: RouterFeaturesConfig = field(default_factory=RouterFeaturesConfig)
    """Mixture-of-experts routing."""

    @property
    def enabled(self) -> bool:
        """Whether any feature is on."""
        return self.attention.enabled or self.weights.enabled or self.router.enabled


@dataclass
class TensorBoardConfig:
    """What the ``tensorboard`` sink writes: by default an overview of < 200 tags whatever the model size."""

    per_tensor: bool = False
    """The overview (docs/tensorboard.md) holds the run-level scalars and anomaly counts (``0_overview/``) and, per
    family and metric, summaries over all the tensors of the step (``grad_reduced/norm_max``, ``norm_median``,
    ``norm_argmax``, ..., ``nonfinite_tensors``), computed on the sink's writer thread. ``true``: also write one tag
    per tensor and metric, ``{family}/{name}/{metric}`` (with ``/vpp{v}``, ``/micro{m}`` when not 0), for the tensors
    that ``tensors`` selects, and every scalar (the per-parameter grad-probe scalars of those tensors, every
    ``lr/group{i}``). About 12,000 tags per rank at a 7B shape, which TensorBoard takes minutes to load: narrow them
    with ``tensors``, ``families`` and ``metrics``. Set by msprobe configs with ``format: tensorboard`` (msprobe
    writes a tag per tensor)."""
    tensors: list[str] = setting(["*"], check=each(_tensor_pattern))
    """The tensors whose per-tensor tags are written, by row name (``layers.0.mlp.fc1.weight``,
    ``layers.0.mlp.output``): exact names, globs (``layers.0.*``) or regexes (``re:^layers\\.(0|31)\\.``).
    Needs ``per_tensor: true``."""
    families: list[str] | None = setting(None, choices=FAMILIES, unique=True)
    """The families written to TensorBoard (summaries and per-tensor tags); null: every family collected."""
    metrics: list[str] | None = setting(None, choices=ROW_METRICS, unique=True)
    """The metrics written to TensorBoard (their summaries and per-tensor tags); null: every metric collected."""

    def cross_check(self, path: str) -> None:
        """A tensor filter without per-tensor tags would select nothing: a mistake, not a choice."""
        if self.tensors != ["*"] and not self.per_tensor:
            raise ConfigError(f"{path}.tensors", "selects the per-tensor tags: set per_tensor: true as well")


@dataclass
class AnomalyConfig:
    """Anomaly detectors and what happens when they fire."""

    detectors: list[dict[str, Any]] = setting([], check=check_specs)
    """Detector specs, each ``{type: nonfinite|spike|loss_spike|growth|level, ...}`` (docs/anomaly.md), run in
    addition to the default detectors (``default_detectors``). A spec replaces the default it overlaps rather than
    running next to it: a ``nonfinite`` or ``loss_spike`` spec replaces that default, a ``spike``, ``growth`` or
    ``level`` spec each default of its type sharing a ``series`` entry with it."""
    default_detectors: bool = True
    """Run the default detectors: ``nonfinite``, ``loss_spike``, the per-layer gradient early warning
    (``{type: spike, series: ["grad_reduced/*/norm"], method: log, persist: 3}``), the global gradient norm
    watch (``{type: spike, series: [grad_norm], method: log, threshold: 7, min_relative_change: 2.2,
    range_factor: 3}``: a jump above 3.2x its level) and drop watch (the same, ``direction: down``, 10x), the
    attention logit growth (``{type: growth, series: ["attn/*/max_logit"], window: 40, factor: 3, min_value: 30}``)
    and Adam's epsilon underflow (``{type: level, series: ["precursors/*/eps_underflow"], threshold: 0.9,
    persist: 5}``). ``false``: only ``detectors`` run."""
    actions: list[str] = setting(["log", "jsonl"], choices=ACTIONS, unique=True)
    """Any of log, jsonl, callback, raise, dump, free_benchmark, rollback (stop the run with
    ``rollback.exit_code`` on an event of ``rollback.detectors``, naming the last healthy checkpoint and the data
    to skip in ``{run}/rollback.json``)."""
    log_limit: int = setting(10, minimum=1)
    """At most this many log lines per step (the rest are summarised)."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    """The step guard: skip a poisoned step instead of applying it."""
    rollback: RollbackConfig = field(default_factory=RollbackConfig)
    """Healthy checkpoints, the skip list, and what the ``rollback`` action does."""


@dataclass
class DumpConfig:
    """Targeted tensor dump of the modules implicated by an anomaly."""

    enabled: bool = False
    """Allow dumps (as the ``dump`` action or through ``monitor.dump``)."""
    mode: str = setting("statistics", choices=DUMP_MODES)
    """statistics, tensor or md5."""
    depth: int = setting(1, minimum=0, maximum=MAX_DUMP_DEPTH)
    """Also dump the parent and children this many levels around the implicated module (at most 64)."""
    max_bytes: int = setting(1 << 30, minimum=1)
    """Byte budget of one dump."""
    max_dumps: int = setting(3, minimum=1)
    """Dumps per run."""
    stack: bool = True
    """Write ``stack.json``: the Python call stack of each dumped forward call."""


@dataclass
class FreeBenchmarkConfig:
    """Perturbation checks of a module's forward."""

    enabled: bool = False
    """Allow free-benchmark checks (as the ``free_benchmark`` action or by hand)."""
    pert_mode: str = setting("improve_precision", choices=PERT_MODES)
    """improve_precision, add_noise, bit_noise, change_value, no_change or to_cpu."""
    handler: str = setting("check", choices=HANDLERS)
    """check: compare and write failures to ``free_benchmark.csv``; fix: also replace the module's
    output by the improve_precision / to_cpu result (value only; gradients flow through the original)."""
    targets: list[str] = _patterns([])
    """Modules checked every ``interval`` steps (exact names, globs or ``re:`` regexes); empty: only on anomaly
    or by hand."""
    interval: int = setting(1, minimum=1)
    """Check ``targets`` on every N-th step."""
    max_per_step: int = setting(4, minimum=1)
    """At most this many modules are re-run per step (a whole network is never re-run by accident)."""

    def cross_check(self, path: str) -> None:
        """``handler: fix`` needs a perturbation whose result may replace the output."""
        if self.handler == "fix" and self.pert_mode not in FIXING_PERT_MODES:
            raise ConfigError(f"{path}.handler", f"fix needs pert_mode improve_precision or to_cpu, "
                                                 f"got {self.pert_mode!r}")


@dataclass
class DynamicConfig:
    """Re-reading the config file while training."""

    watch: bool = False
    """Re-read the config file when it changes; the new config applies from the next step."""
    poll_seconds: float = setting(5.0, minimum=0.0)
    """Check the file's modification time at most this often."""


@dataclass
class MonitorConfig:
    """The whole monitor configuration; every key is optional."""

    enabled: bool = True
    """Master switch; ``false`` makes every step uncollected."""
    output_dir: str = "./trainmon_output"
    """Directory that receives ``{run_name}/``."""
    run_name: str | None = setting(None, check=_directory_name)
    """Run directory name; default a UTC timestamp (shared by all ranks; ``-1``, ``-2``, ... added when a run of
    that second exists: independent processes never share a default run). A name given here appends to its run."""
    sinks: list[str] = setting(["parquet", "tensorboard"], choices=SINKS, unique=True)
    """Outputs: parquet (the run store: docs/store.md), tensorboard (what it writes: ``tensorboard``), csv."""
    ranks: list[int] | None = setting(None, minimum=0, unique=True, check=_some_rank)
    """Ranks that collect and write (distinct, each below the world size: checked at ``attach``); null means
    every rank."""
    write_replicated_once: bool = True
    """Rows that are the same on every rank of a data-parallel group are written by one rank of the group (the
    lowest that ``ranks`` selects) instead of by each: ``grad_reduced``, ``param`` and the optimizer-state families
    under torch DDP (or a ``dp_group`` given to ``attach``) and Megatron-Core, and the combined shard rows of FSDP2,
    DeepSpeed and Megatron's distributed optimizer. Every rank still computes them and its anomaly detectors see
    them as before; ``run.json`` records the groups, and ``trainmon query`` / ``open_run`` show the writer's rows
    for every rank of its group (docs/store.md). ``false``: every rank writes its own copy."""
    absent_ranks: str = setting("error", choices=ABSENT_RANKS)
    """A rank listed in ``ranks`` that the job does not have (a smaller job than the config was written for):
    ``error`` fails at ``attach``; ``skip`` warns once, naming them, and the listed ranks that exist collect
    (msprobe's ``module_ranks``: translated msprobe configs set it). Listing no rank that exists fails either way."""
    start_step: int = setting(0, minimum=0)
    """First step that is collected."""
    step_interval: int = setting(1, minimum=1)
    """Collect every N-th step from ``start_step``."""
    collect_times: int | None = setting(None, minimum=1)
    """Stop after this many collected steps; null means no limit."""
    eps: float = setting(1e-8, minimum=0.0)
    """``zeros`` counts elements with ``|x| < eps``."""
    async_results: bool = False
    """Finish each collected step one step later (for GPUs): the step's statistics are copied to the host without
    waiting for the device, and its rows are written and checked for anomalies when the next step ends (or at
    ``close``). ``monitor.step()`` then returns the previous collected step's record, and an anomaly's actions
    (``raise`` included) come one step later. Off: the step waits for its statistics (one synchronisation).
    MindSpore runs always finish at once."""
    flush_seconds: float = setting(2.0, check=_timeout)
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
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    """Model features: attention logits and entropy, spectral norms, MoE routing."""
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    """What the TensorBoard sink writes."""
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

    def cross_check(self, path: str) -> None:
        """The hand-off actions need their sections enabled."""
        for action, section in (("dump", self.dump), ("free_benchmark", self.free_benchmark)):
            if action in self.anomaly.actions and not section.enabled:
                raise ConfigError("anomaly.actions", f"{action!r} needs {action}.enabled: true")
            if self.anomaly.guard.enabled and action in self.anomaly.guard.escalate and not section.enabled:
                raise ConfigError("anomaly.guard.escalate", f"{action!r} needs {action}.enabled: true")


def check_ranks(ranks: list[int] | None, world_size: int, absent: str = "error") -> list[int] | None:
    """Check the config's ``ranks`` against the job's world size (called at ``attach``).

    Args:
        ranks: ``MonitorConfig.ranks`` (None: every rank).
        world_size: the number of ranks of the job.
        absent: ``MonitorConfig.absent_ranks``: ``skip`` warns about listed ranks the job does not have.

    Returns:
        The listed ranks that exist, in the config's order (None: every rank).

    Raises:
        ConfigError: a listed rank does not exist (``absent: error``) or none does; ``ranks`` is named, with
            the valid range.

    Example:
        >>> check_ranks([0, 3], world_size=2)  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        ConfigError: ranks: rank 3 does not exist: this job has 2 ranks (0..1)
    """
    if ranks is None:
        return None
    missing = [rank for rank in ranks if not 0 <= rank < world_size]
    present = [rank for rank in ranks if rank not in missing]
    if not missing:
        return present
    listed = ", ".join(str(rank) for rank in missing[:10]) + (", ..." if len(missing) > 10 else "")
    reason = (f"rank{'s' if len(missing) > 1 else ''} {listed} {'do' if len(missing) > 1 else 'does'} not exist: "
              f"this job has {world_size} rank{'s' if world_size != 1 else ''} (0..{world_size - 1})")
    if absent == "error" or not present:
        raise ConfigError("ranks", reason + ("" if present else f"; list a rank below {world_size}"))
    # absent_ranks: skip is msprobe's rule: name its key too, for a msprobe config's user
    logging.getLogger("trainmon").warning("trainmon: ranks (msprobe: module_ranks): %s; collecting on rank%s %s only "
                                          "(absent_ranks: skip)", reason, "s" if len(present) > 1 else "",
                                          ", ".join(map(str, present)))
    return present


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

