"""How much a run writes: rows and bytes per collected step, projected at attach (docs/sizing.md).

The projection is plain arithmetic over what the attachment measures and what the config asks for:

- **rows per collected step**, per family: the parameter families (``grad_*``, optimizer states, ``param``)
  have one row per measured parameter, exactly; the activation families are an estimate: target modules that
  have a forward of their own x (input + output) x micro-steps (a tuple input or output, a module called twice in
  a micro-step, an integer input writing no row make the real count differ);
- **bytes per row**, per sink: CSV from the row's text (the names, the step, one value per configured metric),
  TensorBoard per metric point from its tag (only with ``tensorboard.per_tensor``, for the tensors it selects),
  Parquet a measured constant (docs/store.md);
- **TensorBoard's overview**: a constant per collected step, its summaries of each family (their tags' text and
  a point each), whatever the model size;
- **per run**: collected steps (``step_interval``, ``collect_times``) x the ranks that write each family: every
  writing rank, but one per data-parallel group for the families written once per group
  (``write_replicated_once``: :mod:`trainmon.runtime.replicas`); the overview on every writing rank.

Only the rows of the row families are counted: ``scalars`` (a few per step), ``comm`` (depends on the
collectives run), anomaly events and the grad probe's files are not.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from trainmon.base.precursors import PRECURSORS
from trainmon.base.records import FEATURE_METRICS
from trainmon.config import family_metrics
from trainmon.sinks.tensorboard_overview import NONFINITE, TagSelection, overview_tags

if TYPE_CHECKING:
    from trainmon.config import MonitorConfig
    from trainmon.integrations.base import Attachment
    from trainmon.sinks.store_replicas import ReplicaLayout

logger = logging.getLogger("trainmon")

ACTIVATION_FAMILIES = ("actv", "actv_grad")
ADAM_FAMILIES = ("exp_avg", "exp_avg_sq", "update", "ratio", PRECURSORS)
"""Optimizer-state families an Adam-like optimizer (one with ``betas``) writes."""

PARQUET_BYTES_FIXED = 2.0
PARQUET_BYTES_PER_METRIC = 2.0
"""Parquet bytes per row = fixed + per metric: 16 with the 7 default metrics (15.0 measured on a real run,
19.5 on synthetic values: docs/store.md); fewer metric columns cost proportionally less."""
TENSORBOARD_BYTES_PER_POINT = 10
"""Bytes of one TensorBoard scalar beyond its tag's text (protobuf framing and a float32 value)."""
CSV_VALUE_CHARS = {"norm": 20, "min": 21, "max": 20, "mean": 21, "zeros": 10, "nans": 3, "infs": 3,
                   "update_weight_ratio": 22, "g2_v_rms": 18, "g2_v_max": 18, "eps_underflow": 10,
                   "cos_update_grad": 20, "cos_m_g": 20}
"""Typical text width of one value: ``repr`` of a float32-exact float64 (17 digits), ``0.0`` for the counts; the
precursors' (divisions on the host in float64) ``repr`` of a float64."""
CSV_STEP_DIGITS = 5
"""Digits of a typical step (10,000 steps)."""
MB = 1e6


@dataclass(frozen=True)
class FamilySize:
    """One family's rows per collected step and bytes per row in each sink.

    Attributes:
        family: the family (``grad_reduced``, ``actv``, ...).
        rows: rows per collected step on one rank.
        estimated: True when ``rows`` is an estimate (activations), False when exact.
        bytes_per_row: ``sink -> bytes`` for one row (TensorBoard: the row's metric points together).
    """

    family: str
    rows: int
    estimated: bool
    bytes_per_row: dict[str, float]

    def bytes(self, sinks: Iterable[str]) -> float:
        """Bytes per collected step in ``sinks``."""
        return self.rows * sum(self.bytes_per_row.get(sink, 0.0) for sink in sinks)


@dataclass(frozen=True)
class Sizing:
    """The projection for one rank and its run (see the module docstring and docs/sizing.md).

    Example:
        >>> size = Sizing((FamilySize("grad_reduced", 291, False, {"parquet": 16.0}),), ("parquet",),
        ...               step_interval=10, collect_times=None, world_size=64)
        >>> size.rows_per_step, size.bytes_per_step, size.bytes_per_steps(1000)
        (291, 4656.0, 465600.0)
        >>> size.bytes_per_run(1000), replace(size, replicated=("grad_reduced",), replica_writers=8).bytes_per_run(1000)
        (29798400.0, 3724800.0)
    """

    families: tuple[FamilySize, ...]
    sinks: tuple[str, ...]
    step_interval: int = 1
    collect_times: int | None = None
    world_size: int = 1
    """The ranks that write."""
    not_counted: tuple[str, ...] = field(default=())
    """Families turned on whose rows are not projected (``comm``)."""
    overview_bytes: float = 0.0
    """TensorBoard's overview: bytes per collected step (with the tensorboard sink), whatever the rows."""
    replicated: tuple[str, ...] = field(default=())
    """Families written once per data-parallel group (``write_replicated_once``)."""
    replica_writers: int | None = None
    """The ranks that write :attr:`replicated` (one per group); None: every writing rank."""

    @property
    def rows_per_step(self) -> int:
        """Rows per collected step on one rank."""
        return sum(f.rows for f in self.families)

    @property
    def estimated(self) -> bool:
        """Whether any family's rows are an estimate."""
        return any(f.estimated for f in self.families)

    @property
    def bytes_per_step(self) -> float:
        """Bytes per collected step on one rank, in every configured sink together."""
        overview = self.overview_bytes if "tensorboard" in self.sinks else 0.0
        return sum(f.bytes(self.sinks) for f in self.families) + overview

    def collected(self, steps: int) -> int:
        """Collected steps among ``steps`` steps from the first collected one."""
        count = math.ceil(steps / self.step_interval)
        return count if self.collect_times is None else min(count, self.collect_times)

    def bytes_per_steps(self, steps: int) -> float:
        """Bytes on one rank (one that writes every family) for ``steps`` steps."""
        return self.collected(steps) * self.bytes_per_step

    def bytes_per_run(self, steps: int) -> float:
        """Bytes of every writing rank together for ``steps`` steps (:attr:`replicated` by :attr:`replica_writers`
        ranks only)."""
        writers = self.world_size if self.replica_writers is None else self.replica_writers
        per_step = sum(f.bytes(self.sinks) * (writers if f.family in self.replicated else self.world_size)
                       for f in self.families)
        overview = self.overview_bytes * self.world_size if "tensorboard" in self.sinks else 0.0
        return self.collected(steps) * (per_step + overview)

    def line(self) -> str:
        """The one log line of :func:`log_sizing`."""
        about = "about " if self.estimated else ""
        parts = ", ".join(f"{f.family} {'~' if f.estimated else ''}{f.rows:,}" for f in self.families if f.rows)
        uncounted = f"; {', '.join(self.not_counted)} not counted" if self.not_counted else ""
        interval = f" at step_interval {self.step_interval}" if self.step_interval > 1 else ""
        capped = f" (collect_times {self.collect_times})" if self.collect_times is not None else ""
        per_1000 = self.bytes_per_steps(1000)
        once = [f.family for f in self.families if f.family in self.replicated and f.rows]
        by = (f", {', '.join(once)} by {self.replica_writers} of them (once per data-parallel group)"
              if once and self.replica_writers is not None else "")
        ranks = f" (x{self.world_size} ranks{by}: {human_bytes(self.bytes_per_run(1000))})" \
            if self.world_size > 1 else ""
        return (f"trainmon: {about}{self.rows_per_step:,} rows per collected step ({parts or 'none'}{uncounted}); "
                f"with sinks [{', '.join(self.sinks)}] {about}{human_bytes(self.bytes_per_step)} per collected step "
                f"per rank, {human_bytes(per_1000)} per 1,000 steps{interval}{capped}{ranks}; see docs/sizing.md")

    def as_dict(self) -> dict[str, Any]:
        """The projection for ``run.json``."""
        return {"rows_per_collected_step": {f.family: f.rows for f in self.families},
                "estimated": [f.family for f in self.families if f.estimated],
                "bytes_per_row": {f.family: f.bytes_per_row for f in self.families},
                "tensorboard_overview_bytes_per_collected_step": round(self.overview_bytes),
                "bytes_per_collected_step": round(self.bytes_per_step),
                "bytes_per_1000_steps": round(self.bytes_per_steps(1000)),
                "writing_ranks": self.world_size,
                "replicated": list(self.replicated), "replica_writers": self.replica_writers,
                "bytes_per_1000_steps_all_ranks": round(self.bytes_per_run(1000)),
                "not_counted": list(self.not_counted)}


def human_bytes(size: float) -> str:
    """``1234567.0 -> '1.2 MB'`` (decimal units, one decimal below 10)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", MB), ("kB", 1e3)):
        if size >= scale:
            value = size / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:,.0f} {unit}"
    return f"{size:.0f} B"


@dataclass
class Measured:
    """What an attachment measures, framework-free: the input of :func:`project`.

    Attributes:
        params: names of the measured parameters (those that get gradient rows).
        modules: names of the activation target modules that run a forward of their own.
        optimizer_states: the optimizer-state families the optimizer keeps (``exp_avg``, ...); None when unknown
            (then every configured state is counted, but ``momentum`` only when no Adam family is configured: an
            optimizer keeps one or the other); ``[]`` without an optimizer.
        has_optimizer: False when no optimizer was given (then only ``grad_unreduced``).
    """

    params: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    optimizer_states: list[str] | None = None
    has_optimizer: bool = True


def project(measured: Measured, config: MonitorConfig, *, grad_acc_steps: int = 1, world_size: int = 1) -> Sizing:
    """The projection for what ``measured`` names under ``config``.

    Args:
        measured: the parameters and modules the attachment measures.
        config: the monitor config (families, metrics, sinks, step_interval, collect_times).
        grad_acc_steps: micro-steps per step (activations, and ``grad_unreduced`` with ``per_micro_step``,
            write a row per micro-step).
        world_size: ranks that write (the per-run figures multiply by it).
    """
    families: list[FamilySize] = []
    not_counted: list[str] = []
    board = config.tensorboard
    selection = TagSelection(board.per_tensor, board.tensors, board.families, board.metrics)
    overview = 0.0
    for family, metrics in family_metrics(config).items():
        names = _row_names(family, measured, config)
        if names is None:
            not_counted.append(family)
            continue
        repeat = grad_acc_steps if family in ACTIVATION_FAMILIES or (
            family == "grad_unreduced" and config.weight_grads.per_micro_step) else 1
        families.append(FamilySize(family, len(names) * repeat, family in ACTIVATION_FAMILIES,
                                   _bytes_per_row(family, names, metrics, selection)))
        overview += _overview_bytes(family, metrics, selection) if names else 0.0
    return Sizing(tuple(families), tuple(config.sinks), config.step_interval, config.collect_times, world_size,
                  tuple(not_counted), overview)


def _row_names(family: str, measured: Measured, config: MonitorConfig) -> list[str] | None:
    """The row names of ``family`` per micro-step (activations: estimated); None when not projected."""
    if family in ACTIVATION_FAMILIES:
        kinds = ("input", "output") if config.activations.inputs else ("output",)
        suffix = "_grad" if family == "actv_grad" else ""
        return [f"{module}.{kind}{suffix}" if module else f"{kind}{suffix}"
                for module in measured.modules for kind in kinds]
    if family == "comm" or family in FEATURE_METRICS:  # the features: as many rows as heads, matrices, experts
        return None
    if family == "grad_unreduced":
        return measured.params
    if not measured.has_optimizer:
        return []  # grad_reduced, param and the states are read in the optimizer's hooks
    if family in ("grad_reduced", "param"):
        return measured.params
    if measured.optimizer_states is None:  # an optimizer keeps Adam's moments or a momentum buffer, not both
        adam = any(state in ADAM_FAMILIES for state in config.optimizer_states.states)
        return [] if family == "momentum" and adam else measured.params
    return measured.params if family in measured.optimizer_states else []


def _bytes_per_row(family: str, names: Sequence[str], metrics: Sequence[str],
                   selection: TagSelection) -> dict[str, float]:
    if not names:
        return {"csv": 0.0, "tensorboard": 0.0, "parquet": 0.0}
    name_chars = sum(len(name) for name in names) / len(names)
    # vpp_stage,name,step,micro_step,<metric>...\r\n (csv.writer ends rows with \r\n)
    csv_row = 2 + name_chars + 1 + CSV_STEP_DIGITS + 1 + 2 + sum(CSV_VALUE_CHARS[m] + 1 for m in metrics) - 1 + 2
    # per_tensor: one point per selected tensor and metric, tagged {family}/{name}/{metric}; spread over every row
    chosen = [name for name in names if selection.family(family) and selection.tensor(name)]
    chosen_chars = sum(len(name) for name in chosen)
    tags = sum(len(chosen) * (len(family) + 1 + 1 + len(metric) + TENSORBOARD_BYTES_PER_POINT) + chosen_chars
               for metric in metrics if selection.metric(metric)) / len(names)
    return {"csv": round(csv_row, 1), "tensorboard": round(tags, 1),
            "parquet": PARQUET_BYTES_FIXED + PARQUET_BYTES_PER_METRIC * len(metrics)}


def _overview_bytes(family: str, metrics: Sequence[str], selection: TagSelection) -> float:
    """TensorBoard's overview of ``family`` per collected step: one point per summary, as a per-tensor point."""
    if not selection.family(family):
        return 0.0
    tags = overview_tags(family, [metric for metric in metrics if selection.metric(metric)])
    nonfinite = f"{family}/{NONFINITE}"
    if nonfinite not in tags and {"norm", "nans", "infs"} & set(metrics):  # counted from every metric collected
        tags.append(nonfinite)
    return float(sum(len(tag) + TENSORBOARD_BYTES_PER_POINT for tag in tags))


def measured_by(attachment: Attachment) -> Measured:
    """What the attachment's collectors measure (read from them without calling into a framework).

    Parameters come from the weight collectors (``params``; those that do not require a gradient have no
    rows), modules from the activation collectors (``modules``; containers without a forward, such as a
    ``ModuleList``, never run and have no rows). The optimizer's states are known for torch optimizers from
    their ``defaults`` (``betas``: Adam's four families; ``momentum`` > 0: ``momentum``).
    """
    measured = Measured(has_optimizer=attachment.optimizer is not None)
    for collector in attachment.collectors:
        part = getattr(collector, "PART", "")
        if part == "activations":
            measured.modules += [name for name, module, _ in getattr(collector, "modules", ()) if _runs(module)]
        elif part == "weights" and hasattr(collector, "params"):
            measured.params += [name for name, param, _ in collector.params
                                if getattr(param, "requires_grad", True)]
            states = _optimizer_states(getattr(collector, "parts", None))
            if states is not None:
                measured.optimizer_states = states
    return measured


def _runs(module: Any) -> bool:
    """Whether a module runs a forward of its own: not a torch ``ModuleList`` or ``ModuleDict`` (their ``forward`` is
    torch's ``_forward_unimplemented``); a MindSpore cell (``construct``, no ``forward``) counts as running."""
    forward = getattr(type(module), "forward", None)
    return getattr(forward, "__name__", "") != "_forward_unimplemented"


def _optimizer_states(parts: Any) -> list[str] | None:
    """The state families torch optimizers keep, from their ``defaults``; None when not all are known."""
    if not parts:
        return None
    states: set[str] = set()
    for part in parts:
        defaults = getattr(part, "defaults", None)
        if not isinstance(defaults, dict):
            return None
        if "betas" in defaults:
            states.update(ADAM_FAMILIES)
        if defaults.get("momentum"):
            states.add("momentum")
    return sorted(states)


def log_sizing(attachment: Attachment, config: MonitorConfig, grad_acc_steps: int = 1,
               replicas: ReplicaLayout | None = None) -> Sizing:
    """Log the projection as one info line (on the rank that writes ``run.json``) and return it.

    Args:
        replicas: the run's layout of the families written once per data-parallel group (None: none are).
    """
    writing = len([r for r in config.ranks if r < attachment.world_size]) if config.ranks else attachment.world_size
    sizing = project(measured_by(attachment), config, grad_acc_steps=grad_acc_steps, world_size=writing)
    if replicas is not None and replicas.families:
        groups = replicas.groups()
        sizing = replace(sizing, replicated=tuple(replicas.families),
                         replica_writers=writing - sum(len(group) - 1 for group in groups))
    logger.info("%s", sizing.line())
    return sizing
