"""The whole configuration, :class:`MonitorConfig`: the run's outputs, ranks and schedule and one field per section
(with the top-level sections of its own: ``tensorboard``, ``dynamic``), and :func:`check_ranks` (re-exported by
:mod:`trainmon.config`)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from trainmon.base.records import FAMILIES, ROW_METRICS
from trainmon.base.schema import each, setting, short
from trainmon.base.targets import compile_pattern
from trainmon.config.anomaly import AnomalyConfig, DumpConfig, FreeBenchmarkConfig
from trainmon.config.collection import (
    ActivationsConfig,
    CommunicationConfig,
    GradProbeConfig,
    OptimizerStatesConfig,
    ParamsConfig,
    TargetsConfig,
    WeightGradsConfig,
)
from trainmon.config.features import FeaturesConfig
from trainmon.errors import ConfigError

__all__ = ["ABSENT_RANKS", "SINKS", "DynamicConfig", "MonitorConfig", "TensorBoardConfig", "check_ranks"]

SINKS: tuple[str, ...] = ("csv", "tensorboard", "parquet")
ABSENT_RANKS: tuple[str, ...] = ("error", "skip")


def _tensor_pattern(value: str, path: str) -> None:
    compile_pattern(value, path)


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
