"""Free benchmark: re-run a module's forward on perturbed inputs and compare with its output.

On an armed step the module's forward pre-hook saves the RNG states and a copy of the inputs;
its forward hook re-runs a hook-free copy of the module (see :func:`shadow_module`) on perturbed
inputs without gradients from the saved RNG states, then restores every RNG state, so
training is not disturbed (weights stay bit-identical). The comparison stays on the device;
:meth:`FreeBenchmark.end_step` copies the step's results to the host once and appends
failures to ``rank{R}/free_benchmark.csv`` on a writer thread of its own (a full or slow disk never
reaches training; what could not be written is counted and reported at close).

torch (plain, DDP, DeepSpeed, Megatron-Core chunks) and MindSpore cells are served through
:class:`~trainmon.actions.perturb.RerunOps`. Recompute re-runs of checkpointed forwards are not
checked; in a multi-rank job a module whose forward communicates (a tensor-parallel all-reduce) is
not re-run on one rank alone: the collective is refused before it is sent and the module is skipped.
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from trainmon.actions.frameworks import Framework, TorchFramework
from trainmon.actions.modules import Key, ModuleTable
from trainmon.actions.perturb import CollectiveInRerun, converts_precision
from trainmon.actions.requests import StepRequests
from trainmon.base.threads import OutputThread
from trainmon.collect.hooks import HookRegistry
from trainmon.sinks.csv import open_csv_table

if TYPE_CHECKING:
    from trainmon.actions.frameworks import ForwardHook, ForwardPreHook
    from trainmon.config import FreeBenchmarkConfig

logger = logging.getLogger("trainmon")
_GROUP = "free_benchmark"
CSV_HEADER: tuple[str, ...] = ("rank", "pert_mode", "stage", "step", "name", "max_rel", "dtype", "shape",
                               "output_index", "vpp_stage")


@dataclass
class CheckResult:
    """One compared output tensor of one checked module call.

    Attributes:
        step, name, output_index: where (``output_index`` is the tensor's position in the output).
        vpp_stage: the model chunk of the module (Megatron virtual pipeline stages; 0 otherwise).
        pert_mode: the perturbation.
        max_rel: largest elementwise ratio (``inf`` for a sign flip or a one-sided NaN/Inf).
        limit: the pass threshold for ``dtype``.
        dtype, shape: of the original output tensor.
    """

    step: int
    name: str
    output_index: int
    pert_mode: str
    max_rel: float
    limit: float
    dtype: str
    shape: tuple[int, ...]
    vpp_stage: int = 0

    @property
    def passed(self) -> bool:
        return self.max_rel <= self.limit  # NaN compares False: a NaN ratio fails


class FreeBenchmark:
    """Perturbation checks of a few modules' forward passes.

    The owner calls :meth:`begin_step` before each step's first forward and :meth:`end_step`
    after it (every step; both return at once when nothing is due). Modules are checked when
    requested (:meth:`request`, :meth:`on_anomaly`: the next step) and, with
    ``free_benchmark.targets``, every ``interval`` steps; never more than ``max_per_step``
    modules in one step. With ``handler: fix`` requested modules stay fixed on later steps.

    Args:
        model: the root module (inside any DDP wrapper), the list of Megatron-Core model chunks, or a
            MindSpore cell. A name selects the module in every chunk that has it.
        rank_dir: ``{output_dir}/{run_name}/rank{R}``.
        config: the ``free_benchmark`` section.
        rank: written in the CSV's ``rank`` column.
        framework: the model's adapter (:func:`trainmon.integrations.actions_framework`; default: plain torch).

    Raises:
        TargetError: a ``targets`` pattern matches no module.
        ValueError: ``handler: fix`` with a mode other than improve_precision or to_cpu.
    """

    def __init__(self, model: Any, rank_dir: Path, config: FreeBenchmarkConfig, *, rank: int = 0,
                 framework: Framework | None = None) -> None:
        if config.handler == "fix" and not converts_precision(config.pert_mode):
            raise ValueError("free_benchmark.handler: fix needs pert_mode improve_precision or to_cpu, "
                             f"got {config.pert_mode!r}")
        self.config = config
        self.rank = rank
        self.csv_path = Path(rank_dir) / "free_benchmark.csv"
        self.framework: Framework = framework if framework is not None else TorchFramework()
        self.ops = self.framework.rerun_ops()
        self.table = ModuleTable(model, self.framework)
        self.parents = self.table.parents[0]
        self._targets = self.table.select(config.targets, "free_benchmark.targets") if config.targets else []
        self._registry = HookRegistry()
        self._requests: StepRequests[Key] = StepRequests("free_benchmark")
        self._fixed: list[Key] = []
        self._step: int | None = None
        self._done: set[Key] = set()
        self._saved: dict[Key, list[tuple[Any, Any, Any]]] = {}
        self._pending: list[tuple[int, str, int, str, Any, float, str, tuple[int, ...], int]] = []
        self._warned: set[str] = set()
        self._csv: IO[str] | None = None  # opened, written and closed on the writer thread only
        self._output: OutputThread | None = None
        self.results: list[CheckResult] = []
        """Every comparison made so far (passes included), in order."""

    # ------------------------------------------------------------------ requests
    def request(self, modules: Iterable[str], steps: Iterable[int] | None = None) -> list[str]:
        """Check ``modules`` (exact names, globs or ``re:``) on ``steps`` (default: the next step).

        Under ``handler: fix`` a requested module stays fixed from its first requested step on.

        Returns:
            The module names that will be checked (none when ``free_benchmark.enabled`` is false).

        Raises:
            TargetError: a pattern matches no module.
        """
        keys = self.table.select(list(modules), "free_benchmark.modules")
        names = list(dict.fromkeys(name for _, name in keys))
        if not self.config.enabled:
            self._warn_once("disabled", "free_benchmark.enabled is false; the request for %s is ignored", names)
            return []
        self._requests.add(keys, steps, self._step)
        return names

    def on_anomaly(self, events: Iterable[Any]) -> list[str]:
        """The ``free_benchmark`` action: check the first-origin event's module on the next step."""
        keys = self.table.for_events(events, 0)
        if keys and self.config.enabled:
            self._requests.add(keys)
        return [name for _, name in keys]

    # ------------------------------------------------------------------ step lifecycle
    def begin_step(self, step: int) -> None:
        """Arm the modules due on ``step`` (at most ``max_per_step``)."""
        if self._registry.count():
            self.end_step()
        self._step = step
        requested = self._requests.pop(step)
        if self.config.handler == "fix":
            self._fixed.extend(k for k in requested if k not in self._fixed)
        due = requested + self._fixed
        if self._targets and step % self.config.interval == 0:
            due += self._targets
        if not due or not self.config.enabled:
            return
        keys = list(dict.fromkeys(due))
        if len(keys) > self.config.max_per_step:
            self._warn_once("budget", "free_benchmark.max_per_step=%d: checking %d of %d modules this step",
                            self.config.max_per_step, self.config.max_per_step, len(keys))
            keys = keys[: self.config.max_per_step]
        self._done = set()
        framework = self.framework
        for key in keys:
            module = self.table.entries[key].module
            self._registry.add(_GROUP, framework.forward_pre_hook(module, self._pre_hook(key)))
            self._registry.add(_GROUP, framework.forward_hook(module, self._forward_hook(key)))

    def end_step(self) -> list[CheckResult]:
        """Remove the hooks, copy the step's results to the host and append failures to the CSV.

        Returns:
            This step's results (passes included).
        """
        self._registry.remove(_GROUP)
        self._saved.clear()
        pending, self._pending = self._pending, []
        if not pending:
            return []
        values = self.ops.to_host([p[4] for p in pending])  # sync: one transfer per checked step
        results = [CheckResult(step, name, index, mode, value, limit, dtype, shape, chunk)
                   for (step, name, index, mode, _, limit, dtype, shape, chunk), value in zip(pending, values)]
        self.results.extend(results)
        failures = [[self.rank, r.pert_mode, "forward", r.step, r.name, _fmt(r.max_rel), r.dtype, list(r.shape),
                     r.output_index, r.vpp_stage] for r in results if not r.passed]
        if failures:
            if self._output is None:
                self._output = OutputThread("free_benchmark.csv", self._write_rows, self._flush_csv, self._close_csv)
            self._output.submit(failures)
        return results

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the failures found so far are in ``free_benchmark.csv``; False after ``timeout`` s."""
        return self._output.wait(timeout) if self._output is not None else True

    def close(self) -> None:
        """Finish the current step, remove every hook and close the CSV within a bounded time
        (idempotent, never raises for an output failure)."""
        self.end_step()
        self._registry.remove_all()
        if self._output is not None:
            self._output.close()
            self._output.report()

    # ------------------------------------------------------------------ hooks
    def _pre_hook(self, key: Key) -> ForwardPreHook:
        framework = self.framework

        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if (key in self._done and self.config.handler == "check") or framework.is_rerun():
                return  # checked once per step; a recompute re-run is never checked
            try:
                self._saved.setdefault(key, []).append(self.ops.save_inputs(args, kwargs))
            except Exception as exc:  # a check must never stop training
                self._warn_once(f"check:{key}", "free_benchmark: cannot save the inputs of %s (%r); not checked",
                                self.table.label(key), exc)

        return hook

    def _forward_hook(self, key: Key) -> ForwardHook:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            saved = self._saved.get(key)
            if not saved or self.framework.is_rerun():
                return None
            entry = saved.pop()
            self._done.add(key)
            label = self.table.label(key)
            try:
                return self._check(key, module, output, entry)
            except CollectiveInRerun as exc:
                self._warn_once(f"comm:{key}", "free_benchmark: %s communicates in its forward (%s); a re-run on "
                                "one rank would hang the group, so it is not checked (check its submodules that "
                                "do not communicate)", label, exc)
            except Exception as exc:  # a check must never stop training
                self._warn_once(f"check:{key}", "free_benchmark: checking %s failed (%r); not checked", label, exc)
            return None

        return hook

    def _check(self, key: Key, module: Any, output: Any, saved: tuple[Any, Any, Any]) -> Any:
        """Re-run ``module`` on perturbed inputs and queue the comparison; the output to use or None."""
        mode = self.config.pert_mode
        ops = self.ops
        label = self.table.label(key)
        try:
            shadow = ops.shadow(module, mode)
        except CollectiveInRerun:
            raise  # reported by the forward hook: re-running it would communicate (FSDP: a sharded parameter)
        except Exception as exc:  # an uncopyable module is skipped, never fatal
            self._warn_once(f"copy:{key}", "free_benchmark: cannot copy module %s (%s); not checked", label, exc)
            return None
        perturbed = ops.rerun(shadow, saved, mode, output)
        originals = list(ops.flat_tensors(output))
        others = list(ops.flat_tensors(perturbed))
        if len(others) != len(originals):
            self._warn_once(f"struct:{key}", "free_benchmark: %s returned a different output structure "
                            "when perturbed; not compared", label)
            return None
        pending = []
        for index, (orig, pert) in enumerate(zip(originals, others)):
            limit = ops.ratio_limit(orig)
            if limit is None:
                continue
            dtype, shape = ops.describe(orig)
            pending.append((self._step or 0, key[1], index, mode, ops.max_ratio(orig, pert), limit, dtype, shape,
                            key[0]))
        fixed = None
        if self.config.handler == "fix":
            fixed = ops.replace_tensors(output, iter([ops.straight_through(o, p) if ops.is_floating(o) else o
                                                      for o, p in zip(originals, others)]))
        self._pending.extend(pending)  # only once everything above succeeded
        return fixed

    # ------------------------------------------------------------------ writer thread
    def _write_rows(self, rows: list[list[Any]]) -> None:
        if self._csv is None:
            # Appended to when the header matches; another header (an older version) keeps its file.
            self._csv, self.csv_path = open_csv_table(self.csv_path.parent, "free_benchmark", CSV_HEADER,
                                                      rows[0][3], self.csv_path.parent.parent)
        csv.writer(self._csv).writerows(rows)

    def _flush_csv(self) -> None:
        if self._csv is not None:
            self._csv.flush()

    def _close_csv(self) -> None:
        handle, self._csv = self._csv, None
        if handle is not None:
            handle.close()

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)


def _fmt(value: float) -> str:
    return "nan" if value != value else ("inf" if value == float("inf") else repr(value))
