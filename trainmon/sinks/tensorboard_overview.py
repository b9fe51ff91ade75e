"""What the TensorBoard outputs write: a bounded overview by default, per-tensor tags on request (framework-free).

The TensorBoard sink and ``trainmon csv2tb`` share this module, so that a run's event files are the same live and
exported. By default a rank writes, whatever the model size:

- per family and metric, a few series over all the tensors of the step (:data:`OVERVIEW_STATS`), tagged
  ``{family}/{metric}_{stat}`` (two parts, so never a per-tensor tag, which has three or more): ``norm_max``,
  ``norm_median``, ``norm_argmax``, ``max_max``, ``min_min``, ``mean_median``, ``zeros_max``, ``nans_sum``,
  ``infs_sum``, and ``{family}/nonfinite_tensors`` (tensors with a NaN or Inf);
- ``norm_argmax`` is the index of the tensor that holds ``norm_max``, in the family's table of tensors (by first
  appearance: execution order), written as text (``{family}/tensors``, Text tab) when it first has rows, each time
  it has doubled, and at the end (the newest text is the whole table: TensorBoard's sampling always keeps it);
- the step's scalars: ``loss``, ``grad_norm``, ``loss_scale``, ``step_skipped`` (:data:`RUN_SCALARS`, each as
  ``0_overview/{name}`` and ``scalars/{name}``), the first :data:`NUMBERED_KEPT` of ``lr/group{i}`` and
  ``loss/micro{m}``, and the other scalars up to :data:`SCALAR_TAGS` tags (a warning names the first one left out).

The ``precursors`` family (docs/precursors.md) has its own: ``update_weight_ratio_max``, ``update_weight_ratio_median``,
``g2_v_rms_max``, ``g2_v_max_max``, ``eps_underflow_max``, ``cos_update_grad_min``, ``cos_m_g_min``.
That is at most 11 tags per family (11 families of tensor statistics), 14 for the four model-feature families
together and 7 for the precursors (their summaries: :data:`OVERVIEW_STATS`), 8 + 40 scalar tags, 6 anomaly tags
(3 detector types) and the Custom Scalars layout: < 200 (:data:`MAX_TAGS`). :class:`TagSelection` ``per_tensor``
adds the per-tensor tags ``{family}/{name}/{metric}[/vpp{v}][/micro{m}]`` and the per-parameter grad-probe scalars
of the tensors it selects, and lifts the bounds on scalars.

The summaries themselves (:data:`OVERVIEW_STATS`, :func:`summarise`, ``nonfinite_tensors`` and how NaN and Inf
count) are computed in :mod:`trainmon.sinks.tensorboard_summaries`; this module holds the tags, the tables of
tensors, the bounds on scalars and :class:`Overview`, which feeds the summaries step by step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import numpy as np
import numpy.typing as npt

from trainmon.base.precursors import PRECURSOR_METRICS
from trainmon.base.records import FAMILIES, FEATURE_METRICS, METRICS, Row, RowKey, is_additive_mask
from trainmon.base.targets import compile_pattern
from trainmon.sinks.tensorboard_summaries import NONFINITE as NONFINITE  # also its address before the split
from trainmon.sinks.tensorboard_summaries import OVERVIEW_STATS as OVERVIEW_STATS  # also its address before the split
from trainmon.sinks.tensorboard_summaries import summarise as summarise  # also its address before the split

TABLE = "tensors"
"""The text tag (``{family}/tensors``; ``add_text`` appends ``/text_summary``) of the ``norm_argmax`` index."""
RUN_SCALARS = frozenset({"loss", "grad_norm", "loss_scale", "step_skipped"})
"""The run-level scalars: always written (also as ``0_overview/{name}``)."""
NUMBERED = ("lr/group", "loss/micro")
"""Series numbered by parameter group or micro-step (also in ``0_overview/``)."""
NUMBERED_KEPT = 4
"""The overview writes ``lr/group{i}`` and ``loss/micro{m}`` for i, m below this (all of them with ``per_tensor``)."""
SCALAR_TAGS = 40
"""Tags of the other scalars the overview writes at most (each scalar name takes one or two: ``scalars/x``,
``0_overview/x``)."""
MAX_TAGS = ((len(FAMILIES) - len(FEATURE_METRICS) - 1) * (sum(len(OVERVIEW_STATS[m]) for m in METRICS) + 2)
            + sum(len(OVERVIEW_STATS[m]) for names in FEATURE_METRICS.values() for m in names)
            + sum(len(OVERVIEW_STATS[m]) for m in PRECURSOR_METRICS)
            + 2 * (len(RUN_SCALARS) + SCALAR_TAGS // 2) + 2 * 3 + 1)
"""Tags of an overview at most: per family the summaries, ``nonfinite_tensors`` and the table (a feature family and
``precursors``: their summaries, no ``norm`` hence neither); the scalars; a count and a text per anomaly detector
type; the Custom Scalars layout."""


def summary_tag(family: str, metric: str, stat: str) -> str:
    """The tag of one summary series.

    Example:
        >>> summary_tag("grad_reduced", "norm", "max")
        'grad_reduced/norm_max'
    """
    return f"{family}/{metric}_{stat}"


def overview_tags(family: str, metrics: Iterable[str]) -> list[str]:
    """The summary tags of ``family`` with ``metrics`` (the order written), without the text table.

    Example:
        >>> overview_tags("grad_reduced", ["norm", "nans"])
        ['grad_reduced/norm_max', 'grad_reduced/norm_median', 'grad_reduced/norm_argmax', \
'grad_reduced/nans_sum', 'grad_reduced/nonfinite_tensors']
    """
    metrics = list(metrics)
    tags = [summary_tag(family, metric, stat) for metric in metrics for stat in OVERVIEW_STATS.get(metric, ())]
    if {"norm", "nans", "infs"} & set(metrics):
        tags.append(f"{family}/{NONFINITE}")
    return tags


class TagSelection:
    """Which tags are written beyond the overview, and which families and metrics at all (config ``tensorboard``).

    Args:
        per_tensor: also write the per-tensor tags (and the per-parameter grad-probe scalars), without the bound on
            scalar tags.
        tensors: the row names whose per-tensor tags are written: exact names, globs or ``re:`` regexes.
        families: the families written (summaries and per-tensor tags); None: all.
        metrics: the metrics written; None: all.

    Raises:
        ConfigError: an empty or invalid pattern (the key ``tensorboard.tensors[i]``).

    Example:
        >>> selection = TagSelection(per_tensor=True, tensors=["layers.0.*"], metrics=["norm"])
        >>> selection.tensor_tag("grad_reduced", "layers.0.fc.weight", "norm"), selection.metric("max")
        (True, False)
    """

    def __init__(self, per_tensor: bool = False, tensors: Sequence[str] = ("*",),
                 families: Iterable[str] | None = None, metrics: Iterable[str] | None = None) -> None:
        self.per_tensor = per_tensor
        self.tensors = tuple(tensors)
        self._patterns = [compile_pattern(p, f"tensorboard.tensors[{i}]") for i, p in enumerate(self.tensors)]
        self.families = frozenset(families) if families is not None else None
        self.metrics = frozenset(metrics) if metrics is not None else None
        self._names: dict[str, bool] = {}

    def family(self, family: str) -> bool:
        return self.families is None or family in self.families

    def metric(self, metric: str) -> bool:
        return self.metrics is None or metric in self.metrics

    def tensor(self, name: str) -> bool:
        """Whether ``name`` gets per-tensor tags (remembered per name: names repeat every step)."""
        if not self.per_tensor:
            return False
        chosen = self._names.get(name)
        if chosen is None:
            chosen = self._names[name] = any(pattern.matches(name) for pattern in self._patterns)
        return chosen

    def tensor_tag(self, family: str, name: str, metric: str) -> bool:
        """Whether the per-tensor tag of ``family``, ``name`` and ``metric`` is written."""
        return self.family(family) and self.metric(metric) and self.tensor(name)


def per_tensor_scalar(name: str) -> str | None:
    """The tensor of a per-parameter scalar (``grad_probe/{param}/{metric}``), None for a run-level scalar.

    Example:
        >>> per_tensor_scalar("grad_probe/fc.weight/cos_prev"), per_tensor_scalar("grad_probe/cos_prev")
        ('fc.weight', None)
    """
    if not name.startswith("grad_probe/"):
        return None
    parts = name.split("/")
    return "/".join(parts[1:-1]) if len(parts) >= 3 else None


def numbered_beyond(name: str) -> bool:
    """Whether ``name`` is ``lr/group{i}`` or ``loss/micro{m}`` with a number past :data:`NUMBERED_KEPT`.

    Example:
        >>> numbered_beyond("lr/group3"), numbered_beyond("lr/group4"), numbered_beyond("loss/micro12")
        (False, True, True)
    """
    for prefix in NUMBERED:
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            return int(name[len(prefix):]) >= NUMBERED_KEPT
    return False


@dataclass
class _Family:
    """One family's table of tensors (``norm_argmax`` indices) and when it was last written."""

    labels: dict[tuple[str, int, int], int] = field(default_factory=dict)
    """``(name, vpp_stage, micro_step) -> index``, by first appearance."""
    written: int = 0
    last_step: int = -1
    masks: list[bool] = field(default_factory=list)
    """Per index: whether the tensor is an attention mask (:func:`~trainmon.base.records.is_additive_mask`)."""

    def mask_flags(self, family: str, index: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_] | None:
        """Whether each row (by its table index) is an attention mask, whose -inf are not non-finite values; None
        when the family has none."""
        if len(self.masks) < len(self.labels):
            new = list(self.labels)[len(self.masks):]
            self.masks += [is_additive_mask(RowKey(family, name)) for name, _, _ in new]
        if not any(self.masks):
            return None
        return np.asarray(self.masks, bool)[index]


def _label(name: str, vpp: int, micro: int) -> str:
    return name + (f"/vpp{vpp}" if vpp else "") + (f"/micro{micro}" if micro else "")


def table_text(family: str, labels: Iterable[tuple[str, int, int]]) -> str:
    """The markdown table of ``norm_argmax`` indices (``/vpp{v}``, ``/micro{m}`` as in per-tensor tags).

    Example:
        >>> print(table_text("actv", [("fc.output", 0, 0), ("fc.output", 0, 1)]))
        `actv/norm_argmax` is the index of the tensor with the largest norm:
        <BLANKLINE>
        | index | tensor |
        |---:|---|
        | 0 | fc.output |
        | 1 | fc.output/micro1 |
    """
    lines = [f"`{family}/norm_argmax` is the index of the tensor with the largest norm:", "",
             "| index | tensor |", "|---:|---|"]
    lines += [f"| {i} | {_label(*label)} |" for i, label in enumerate(labels)]
    return "\n".join(lines)


Block = tuple[int, dict[str, float], dict[str, str]]
"""One step of a family's overview: ``(step, {tag: value}, {text tag: markdown})``."""


class Overview:
    """The overview of one rank: the summaries of each family per step, and which scalars are written.

    Fed step by step, by the sink (:meth:`record_blocks`) or by ``csv2tb`` (:meth:`blocks`, many steps at once);
    both give the same values and texts for the same rows. :meth:`finish` gives the last tables.

    Args:
        selection: what is written (:class:`TagSelection`).
        on_dropped: called once, with the scalar's name, when the first scalar is left out by the bound.
    """

    def __init__(self, selection: TagSelection | None = None,
                 on_dropped: Callable[[str], None] | None = None) -> None:
        self.selection = selection or TagSelection()
        self._families: dict[str, _Family] = {}
        self._scalars: dict[str, list[str]] = {}
        self._scalar_tags = 0
        self.dropped: list[str] = []
        """Scalar names the bound left out (in order)."""
        self._on_dropped = on_dropped

    # ------------------------------------------------------------------ scalars
    def scalar_tags(self, name: str, tags: Callable[[str], list[str]]) -> list[str]:
        """The tags ``name`` is written under: ``tags(name)``, or none (a per-parameter scalar of a tensor not
        selected; in the overview alone, a numbered series past :data:`NUMBERED_KEPT` or a new scalar beyond
        :data:`SCALAR_TAGS`)."""
        known = self._scalars.get(name)
        if known is not None:
            return known
        tensor = per_tensor_scalar(name)
        chosen = tags(name)
        if tensor is not None:
            chosen = chosen if self.selection.tensor(tensor) else []
        elif self.selection.per_tensor or name in RUN_SCALARS:
            pass
        elif numbered_beyond(name):
            chosen = []
        elif self._scalar_tags + len(chosen) > SCALAR_TAGS:
            if not self.dropped and self._on_dropped is not None:
                self._on_dropped(name)
            self.dropped.append(name)
            chosen = []
        else:
            self._scalar_tags += len(chosen)
        self._scalars[name] = chosen
        return chosen

    # ------------------------------------------------------------------ families
    def record_blocks(self, step: int, rows: Sequence[Row]) -> list[Block]:
        """The overview of one step's rows (a :class:`~trainmon.base.records.StepRecord`'s), family by family."""
        by_family: dict[str, list[Row]] = {}
        for row in rows:
            by_family.setdefault(row.key.family, []).append(row)
        blocks = []
        for family, own in by_family.items():
            metrics = list(own[0].values)
            if not metrics or not self.selection.family(family):
                continue
            pick = itemgetter(*metrics)  # in C, by name
            try:
                values = np.array([pick(row.values) for row in own], dtype=np.float64).reshape(len(own), len(metrics))
            except KeyError:  # rows of several metric lists in one step (not written so by trainmon)
                values = np.array([[row.values.get(m, np.nan) for m in metrics] for row in own], dtype=np.float64)
            state = self._families.setdefault(family, _Family())
            labels = state.labels
            index = np.fromiter((labels.setdefault((row.key.name, row.key.vpp_stage, row.key.micro_step),
                                                   len(labels)) for row in own), np.int64, len(own))
            blocks += self._summaries(family, state, metrics, values, index, np.zeros(1, np.int64),
                                      np.array([step], np.int64))
        return blocks

    def blocks(self, family: str, metrics: Sequence[str], keys: Sequence[tuple[int, str]],
               rows: npt.NDArray[Any], micro_steps: npt.NDArray[Any], steps: npt.NDArray[Any],
               values: npt.NDArray[np.float64]) -> list[Block]:
        """The overview of rows read back (a :class:`~trainmon.tools.readers.Table`'s columns: ``keys[rows[i]]`` is
        row i's ``(vpp_stage, name)``), in the order written: each run of rows of one step is one step."""
        if not len(steps) or not self.selection.family(family):
            return []
        state = self._families.setdefault(family, _Family())
        # the table index of each (row, micro-step), registered in the order of first appearance
        width = int(micro_steps.max()) + 1
        codes = rows.astype(np.int64) * width + micro_steps
        unique, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
        lookup = np.empty(len(unique), np.int64)
        for position in np.argsort(first, kind="stable").tolist():
            vpp, name = keys[int(unique[position]) // width]
            lookup[position] = state.labels.setdefault((name, vpp, int(unique[position]) % width), len(state.labels))
        starts = np.flatnonzero(np.concatenate(([True], steps[1:] != steps[:-1])))
        return self._summaries(family, state, list(metrics), values, lookup[inverse.reshape(-1)], starts,
                               steps[starts])

    def finish(self) -> list[Block]:
        """The tables that grew since they were last written, at their family's last step."""
        blocks: list[Block] = []
        for family, state in self._families.items():
            if len(state.labels) > state.written and state.last_step >= 0:
                state.written = len(state.labels)
                blocks.append((state.last_step, {}, {f"{family}/{TABLE}": table_text(family, state.labels)}))
        return blocks

    def _summaries(self, family: str, state: _Family, metrics: list[str], values: npt.NDArray[np.float64],
                   index: npt.NDArray[np.int64], starts: npt.NDArray[np.int64],
                   steps: npt.NDArray[np.int64]) -> list[Block]:
        chosen = [m for m in metrics if self.selection.metric(m)]
        columns = {metric: values[:, j] for j, metric in enumerate(metrics)}
        series = summarise({m: columns[m] for m in chosen}, starts, index, nonfinite_of=columns,
                           masks=state.mask_flags(family, index))
        tags = {name: f"{family}/{name}" for name in series}
        # size of the table after each step: 1 + the largest index seen so far
        sizes = np.maximum.accumulate(np.maximum.reduceat(index, starts)) + 1 if "norm_argmax" in series else None
        blocks: list[Block] = []
        step_list = steps.tolist()
        lists = {tag: column.tolist() for tag, column in ((tags[n], c) for n, c in series.items())}
        for i, step in enumerate(step_list):
            texts: dict[str, str] = {}
            if sizes is not None and int(sizes[i]) >= max(1, 2 * state.written):
                state.written = int(sizes[i])
                texts[f"{family}/{TABLE}"] = table_text(family, list(state.labels)[:state.written])
            blocks.append((step, {tag: column[i] for tag, column in lists.items()}, texts))
        if step_list:
            state.last_step = step_list[-1]
        if sizes is None:
            state.written = len(state.labels)  # no argmax written: no table to show
        return blocks


__all__ = ["MAX_TAGS", "NUMBERED_KEPT", "RUN_SCALARS", "SCALAR_TAGS", "TABLE", "Overview", "TagSelection",
           "numbered_beyond", "overview_tags", "per_tensor_scalar", "summary_tag", "table_text"]

