"""Host-side records: what one collected step produced, as plain Python floats.

Everything after the single device-to-host transfer of a step lives here and imports no
framework. Collectors produce *partial statistics* per tensor: an 8-slot vector
``[norm, sum, min, max, zeros, nans, infs, numel]`` that combines exactly across shards; that vector and its
arithmetic (``combine_partials``, ``finalize``, ``finalize_many``, the slot indices) live in
:mod:`trainmon.base.partials`, and :func:`build_record` turns a step's partials into its rows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from trainmon.base.partials import PARTIAL_SLOTS, finalize_many
from trainmon.base.partials import combine_partials as combine_partials  # its address before the split (tests)
from trainmon.base.partials import finalize as finalize  # its address before the split (tests)
from trainmon.base.precursors import PRECURSOR_METRICS, PRECURSORS, finalize_precursors, nan_tail, pair_tails

METRICS: tuple[str, ...] = ("norm", "min", "max", "mean", "zeros", "nans", "infs")
"""Every metric a user may ask for, in canonical order."""

FEATURE_METRICS: dict[str, tuple[str, ...]] = {
    "attn": ("max_logit", "entropy"),
    "router": ("imbalance", "entropy", "z_loss", "expert_similarity"),
    "expert_load": ("tokens", "share"),
    "weight_features": ("spectral_norm", "stable_rank"),
}
"""The model-feature families (docs/features.md) and their metrics. A feature row's partial vector holds the values
themselves, in this order, in its first slots (the others are 0): :func:`build_record` reads them as they are."""
OPTIONAL_FEATURES = frozenset({"expert_similarity"})
"""Feature metrics that are NaN when they cannot be computed (no expert weights found): they never flag a row as
non-finite. Every other feature value that is NaN or Inf does."""

FAMILIES: tuple[str, ...] = (
    "actv", "actv_grad", "grad_unreduced", "grad_reduced",
    "exp_avg", "exp_avg_sq", "update", "ratio", "momentum", "param", "comm", *FEATURE_METRICS, PRECURSORS,
)
"""Row families; each is written to ``rank{R}/{family}.csv``."""
ROW_METRICS: tuple[str, ...] = tuple(dict.fromkeys(
    (*METRICS, *(metric for names in FEATURE_METRICS.values() for metric in names), *PRECURSOR_METRICS)))
"""Every column a row family may have: the statistics of a tensor (:data:`METRICS`), the feature families'
(:data:`FEATURE_METRICS`) and the ``precursors`` family's own (:data:`~trainmon.base.precursors.PRECURSOR_METRICS`),
each once."""

PHASE_OF_FAMILY: dict[str, str] = {
    "actv": "forward", "actv_grad": "backward", "grad_unreduced": "backward",
    "grad_reduced": "optimizer", "exp_avg": "optimizer", "exp_avg_sq": "optimizer",
    "update": "optimizer", "ratio": "optimizer", "momentum": "optimizer", "param": "optimizer",
    "comm": "communication", "attn": "forward", "router": "forward", "expert_load": "forward",
    "weight_features": "optimizer", PRECURSORS: "optimizer",
}
PHASES: tuple[str, ...] = ("forward", "backward", "communication", "optimizer", "loss")

GUARD_PREFIX = "step_guard/"
GUARD_VERDICT: tuple[str, ...] = ("skipped", "reason", "param", "value", "baseline", "z", "grad_norm",
                                  "grad_norm_mean", "grad_norm_z")
"""What the step guard found at one step, in this order (:mod:`trainmon.collect.step_guard`): skipped (0/1), the
reason (an index into :data:`GUARD_REASONS`), the parameter it names (an index into the optimizer's parameters),
that parameter's gradient norm, mean and z-score, then the global gradient norm, mean and z-score (means and
z-scores NaN while the history warms up). Sent with the step as scalars ``step_guard/{name}`` (``skipped``
as ``step_skipped``); :mod:`trainmon.anomaly.skips` takes them out of the record before the sinks see it."""
GUARD_REASONS: tuple[str, ...] = ("applied", "nonfinite", "max_grad_norm", "z_score", "parameter_z_score")


def metrics_of(family: str) -> tuple[str, ...]:
    """The metrics a row of ``family`` may have: a feature family's own, the ``precursors`` family's own
    (:data:`~trainmon.base.precursors.PRECURSOR_METRICS`), else the statistics (:data:`METRICS`).

    Example:
        >>> metrics_of("attn"), metrics_of("grad_reduced")[:2], metrics_of("precursors")[:2]
        (('max_logit', 'entropy'), ('norm', 'min'), ('update_weight_ratio', 'g2_v_rms'))
    """
    return PRECURSOR_METRICS if family == PRECURSORS else FEATURE_METRICS.get(family, METRICS)


# --------------------------------------------------------------------------- row names
# The one home of the row-name grammar: ``{module}.{kind}[.{tensor}]`` for activation rows, the full
# parameter name for the others, and ``{family}/{name}/{metric}[/vpp{v}][/micro{m}]`` as a tag (TensorBoard,
# csv2tb) or, without the suffixes, as a ``spike`` detector series.
ACTIVATION_KINDS: dict[str, tuple[str, ...]] = {"actv": ("input", "output"), "actv_grad": ("input_grad", "output_grad")}
"""The row kinds of each activation family: a row is ``{module}.{kind}``, or ``{module}.{kind}.{i}`` for the
i-th tensor of a tuple (``.{key}`` for a keyword argument)."""
_KINDS = frozenset(kind for kinds in ACTIVATION_KINDS.values() for kind in kinds)


def activation_row(module: str, kind: str, tensor: int | str | None = None) -> str:
    """The name of an activation row.

    Example:
        >>> activation_row("layers.0", "input"), activation_row("layers.0", "output_grad", 1)
        ('layers.0.input', 'layers.0.output_grad.1')
    """
    return f"{module}.{kind}" if tensor is None else f"{module}.{kind}.{tensor}"


_CALL = re.compile(r"\.call([1-9][0-9]*)$")


def module_call(module: str, call: int) -> str:
    """The module part of the rows of a module's ``call``-th call (from 0) in one micro-step: the module's
    name for the first call, ``{module}.call{k}`` for the k-th later one.

    Example:
        >>> module_call("layers.0.act", 0), module_call("layers.0.act", 1)
        ('layers.0.act', 'layers.0.act.call1')
    """
    return f"{module}.call{call}" if call else module


def split_module_call(module: str) -> tuple[str, int]:
    """``(module, call)`` of the module part of an activation row (the inverse of :func:`module_call`).

    Example:
        >>> split_module_call("layers.0.act.call2"), split_module_call("layers.0.act")
        (('layers.0.act', 2), ('layers.0.act', 0))
    """
    found = _CALL.search(module)
    return (module[:found.start()], int(found.group(1))) if found else (module, 0)


def split_activation_row(name: str) -> tuple[str, str, str] | None:
    """``(module, kind, tensor)`` of an activation row name (``tensor`` is ``""`` for a lone tensor), read
    from the right, so that a module itself named like a kind (HF BERT's ``layer.0.output``) keeps it;
    None when no part is a kind.

    Example:
        >>> split_activation_row("layer.0.output.output"), split_activation_row("fc.input.1")
        (('layer.0.output', 'output', ''), ('fc', 'input', '1'))
    """
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i] in _KINDS:
            return ".".join(parts[:i]), parts[i], ".".join(parts[i + 1:])
    return None


def row_tag(family: str, name: str, metric: str, micro_step: int = 0, vpp_stage: int = 0) -> str:
    """The tag of one statistic: ``{family}/{name}/{metric}[/vpp{v}][/micro{m}]`` (suffixes only when not 0).

    Example:
        >>> row_tag("actv", "fc.output", "norm"), row_tag("actv", "fc.output", "norm", micro_step=1)
        ('actv/fc.output/norm', 'actv/fc.output/norm/micro1')
    """
    tag = f"{family}/{name}/{metric}"
    if vpp_stage:
        tag += f"/vpp{vpp_stage}"
    if micro_step:
        tag += f"/micro{micro_step}"
    return tag


def split_row_tag(tag: str) -> tuple[str, str, str, int, int] | None:
    """``(family, name, metric, micro_step, vpp_stage)`` of a :func:`row_tag` (the name may hold ``/``);
    None for a tag of fewer than three parts.

    Example:
        >>> split_row_tag("grad_reduced/fc.weight/norm/vpp1/micro2")
        ('grad_reduced', 'fc.weight', 'norm', 2, 1)
    """
    parts = tag.split("/")
    indices = {"micro": 0, "vpp": 0}
    for prefix in ("micro", "vpp"):  # appended in the order vpp, micro
        last = parts[-1]
        if len(parts) > 3 and last.startswith(prefix) and last[len(prefix):].isdigit():
            indices[prefix] = int(last[len(prefix):])
            parts.pop()
    if len(parts) < 3:
        return None
    return parts[0], "/".join(parts[1:-1]), parts[-1], indices["micro"], indices["vpp"]


def split_row_series(text: str) -> tuple[str, str, str] | None:
    """``(family, name, metric)`` of a series ``family/name/metric`` (a tag without suffixes; the name, a
    pattern, may hold ``/``), or None when ``text`` starts with no family (a scalar such as ``lr/group0``).
    Empty parts are returned as they are (the caller says what is wrong).

    Example:
        >>> split_row_series("grad_reduced/layers.*/norm"), split_row_series("lr/group0")
        (('grad_reduced', 'layers.*', 'norm'), None)
    """
    family, _, rest = text.partition("/")
    if family not in FAMILIES:
        return None
    name, _, metric = rest.rpartition("/")
    return family, name, metric


@dataclass(frozen=True, slots=True)
class RowKey:
    """Identity of one statistics row, known on the host when the tensor is measured.

    Attributes:
        family: one of :data:`FAMILIES`.
        name: module/parameter name with its suffix, e.g. ``layers.0.mlp.output``.
        micro_step: forward pass of the root module within the step (0 without accumulation).
        vpp_stage: virtual-pipeline chunk index (0 outside Megatron VPP).
        order: position of the observation in execution order on this rank within the step.
        run_phase: the phase the observation was really made in, when it differs from the
            family's (a ``comm`` row of a collective inside the forward pass is ``forward``);
            empty means the family's phase. Not written to the CSV files.
    """

    family: str
    name: str
    micro_step: int = 0
    vpp_stage: int = 0
    order: int = 0
    run_phase: str = ""

    @property
    def phase(self) -> str:
        """``run_phase`` when set, else the family's phase (:data:`PHASE_OF_FAMILY`)."""
        return self.run_phase or PHASE_OF_FAMILY[self.family]


@dataclass(slots=True)
class Row:
    """One finalised statistics row: a :class:`RowKey` plus ``metric -> float``.

    Not frozen: a frozen dataclass costs three times as much to make, and a step of a 1 B model makes about
    1,500 rows on the training thread, while the device may be idle (after the step's one synchronisation).
    Nothing changes a row once :func:`build_record` made it.
    """

    key: RowKey
    step: int
    values: Mapping[str, float]
    nonfinite: bool
    """True when the tensor held a NaN or Inf, whatever metrics were configured."""

    @property
    def family(self) -> str:
        return self.key.family

    @property
    def name(self) -> str:
        return self.key.name


@dataclass(slots=True)
class StepRecord:
    """Everything one rank collected in one step, after the host transfer.

    Attributes:
        step: optimizer step (counted from ``start_step``).
        rank: global rank that produced the record.
        rows: statistics rows in execution order.
        scalars: ``loss``, ``grad_norm``, ``lr/group{i}`` and integration extras.
        pp_stage: pipeline stage of this rank (0 without pipeline parallelism).
        collected: False for a step that was not collected: only the scalars given to ``step()``.
        batch: the identity of the step's data where the loop gave it (the anomaly events of the step carry it).
    """

    step: int
    rank: int
    rows: list[Row] = field(default_factory=list)
    scalars: dict[str, float] = field(default_factory=dict)
    pp_stage: int = 0
    collected: bool = True
    batch: dict[str, Any] | None = None


def _join_precursors(keys: Sequence[RowKey], partials: npt.NDArray[np.float64]
                     ) -> tuple[list[RowKey], npt.NDArray[np.float64], dict[int, tuple[dict[str, float], bool]]]:
    """The keys and partials without the precursor rows' tails, and each precursor row's values and non-finite
    flag by its index among the kept keys (:func:`~trainmon.base.precursors.finalize_precursors`)."""
    kept, tails = pair_tails(keys)
    rows = [j for j, i in enumerate(kept) if keys[i].family == PRECURSORS]
    joined: dict[int, tuple[dict[str, float], bool]] = {}
    if rows:
        heads = partials[[kept[j] for j in rows]]
        tail_rows = np.stack([partials[tails[j]] if tails[j] >= 0 else nan_tail() for j in rows])
        values, nonfinite = finalize_precursors(heads, tail_rows)
        for k, j in enumerate(rows):
            if tails[j] < 0:  # no tail (a part that failed): what needs it is NaN, which is not the tensors' fault
                nonfinite[k] = not np.isfinite(heads[k]).all()
            joined[j] = ({metric: values[metric][k] for metric in PRECURSOR_METRICS}, nonfinite[k])
    if len(kept) == len(keys):
        return list(keys), partials, joined
    return [keys[i] for i in kept], partials[kept], joined


_MASK = re.compile(r"\.input\.[^.]*mask[^.]*(\.\d+)*$", re.IGNORECASE)


def is_additive_mask(key: RowKey) -> bool:
    """Whether the row is a forward input named as a mask (``attn_mask``, ``src_key_padding_mask``,
    ``attention_mask``, ...): an additive attention mask marks what is masked out with -inf
    (``nn.Transformer.generate_square_subsequent_mask``), so its -inf are its values, not an anomaly; a NaN or
    +inf in it still is (:func:`build_record`).

    Example:
        >>> is_additive_mask(RowKey("actv", "encoder.layers.0.self_attn.input.attn_mask"))
        True
        >>> is_additive_mask(RowKey("actv", "encoder.layers.0.self_attn.output.0"))
        False
    """
    return key.family == "actv" and _MASK.search(key.name) is not None


def build_record(step: int, rank: int, pp_stage: int, keys: Sequence[RowKey], partials: Any,
                 scalars: dict[str, float], metrics: dict[str, list[str]]) -> StepRecord:
    """Finalise the host copy of a step into a :class:`StepRecord` (framework-free), all rows at once.

    A ``precursors`` row is joined here with its second half (a
    :data:`~trainmon.base.precursors.PRECURSORS_TAIL` key, which makes no row of its own).
    """
    if not len(keys):
        return StepRecord(step=step, rank=rank, rows=[], scalars=scalars, pp_stage=pp_stage)
    joined: dict[int, tuple[dict[str, float], bool]] = {}
    if PRECURSORS in metrics:
        keys, partials, joined = _join_precursors(keys, np.asarray(partials, dtype=np.float64).reshape(-1, 8))
    columns, nonfinite = finalize_many(partials)
    for i in [i for i, flag in enumerate(nonfinite) if flag and is_additive_mask(keys[i])]:
        lo, hi = columns["min"][i], columns["max"][i]
        nonfinite[i] = columns["nans"][i] > 0 or math.isnan(lo) or math.isnan(hi) or hi == math.inf
    values: dict[int, list[tuple[float, ...]]] = {}  # per metrics list: every row's values in its order
    features = finalize_features(partials, keys)
    rows = []
    for i, key in enumerate(keys):
        names = metrics[key.family]
        if i in joined:
            row_values, row_nonfinite = joined[i]
            rows.append(Row(key, step, {name: row_values[name] for name in names}, row_nonfinite))
            continue
        feature = features.get(i)
        if feature is not None:
            rows.append(Row(key, step, dict(zip(names, feature[0])), feature[1]))
            continue
        table = values.get(id(names))
        if table is None:
            table = values[id(names)] = list(zip(*(columns[name] for name in names)))
        rows.append(Row(key, step, dict(zip(names, table[i])), nonfinite[i]))
    return StepRecord(step=step, rank=rank, rows=rows, scalars=scalars, pp_stage=pp_stage)


def finalize_features(partials: Any, keys: Sequence[RowKey]) -> dict[int, tuple[tuple[float, ...], bool]]:
    """The rows of the feature families (:data:`FEATURE_METRICS`): ``row index -> (the values in the family's
    metric order, whether a value that is not optional is NaN or Inf)``.

    Example:
        >>> finalize_features(np.array([[3.5, 0.25, 0, 0, 0, 0, 0, 0]]), [RowKey("attn", "attn.head0")])
        {0: ((3.5, 0.25), False)}
    """
    by_family: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        if key.family in FEATURE_METRICS:
            by_family.setdefault(key.family, []).append(i)
    if not by_family:
        return {}
    p = np.asarray(partials, dtype=np.float64).reshape(-1, PARTIAL_SLOTS)
    out: dict[int, tuple[tuple[float, ...], bool]] = {}
    for family, indices in by_family.items():
        names = FEATURE_METRICS[family]
        own = p[indices, :len(names)]
        checked = [j for j, name in enumerate(names) if name not in OPTIONAL_FEATURES]
        flags = (~np.isfinite(own[:, checked]).all(axis=1)).tolist()  # host numpy: no sync
        out.update(zip(indices, zip(map(tuple, own.tolist()), flags)))
    return out
