"""Earliest-first ordering of anomaly events and first-origin wording.

The rule (DESIGN.md): step, then micro-step, then phase, then pipeline position (ascending in
the forward pass, descending in the backward pass, where gradients flow from the last stage to
the first), then ``order`` (execution order on the rank), then rank as a final tie-break.

Phases are ranked ``forward < loss < backward < communication < optimizer``: the loss is computed
at the end of the forward pass and before its backward pass; collectives outside the forward and
backward passes (gradient reduction after ``backward()``) run before the optimizer reads the
gradients. A collective *inside* the forward or backward pass has that phase (``comm`` rows carry
the phase they ran in), so it is ordered by its ``order`` among the rows of that pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from trainmon.anomaly.events import AnomalyEvent
from trainmon.base.records import split_activation_row

PHASE_RANK: dict[str, int] = {"forward": 0, "loss": 1, "backward": 2, "communication": 3, "optimizer": 4}
"""Position of each phase within a micro-step."""

_REVERSED_PHASES = frozenset({"backward"})


def sort_key_fields(step: int, micro_step: int, phase: str, pp_stage: int, vpp_stage: int,
                    order: int, rank: int) -> tuple[int, ...]:
    """Sort key from raw fields (used by the cross-rank analysis without building events)."""
    sign = -1 if phase in _REVERSED_PHASES else 1
    return (step, micro_step, PHASE_RANK.get(phase, len(PHASE_RANK)),
            sign * vpp_stage, sign * pp_stage, order, rank)


def sort_key(event: AnomalyEvent) -> tuple[int, ...]:
    """Earliest-first sort key of one event."""
    return sort_key_fields(event.step, event.micro_step, event.phase, event.pp_stage,
                           event.vpp_stage, event.order, event.rank)


def order_events(events: Iterable[AnomalyEvent]) -> list[AnomalyEvent]:
    """Events sorted earliest first (stable for equal keys)."""
    return sorted(events, key=sort_key)


_KIND_WORDS: dict[str, str] = {"input_grad": "gradient w.r.t. the input of",
                               "output_grad": "gradient w.r.t. the output of",
                               "input": "input of", "output": "output of"}


def _split_suffix(name: str) -> tuple[str, str]:
    """``layers.2.mlp.output.1`` -> (``output of``, ``layers.2.mlp`` + `` (tensor 1)``)."""
    row = split_activation_row(name)
    if row is None:
        return "", name
    module, kind, tensor = row
    module = module or "the root module"  # activations.root (msprobe's all_xy): named ""
    return _KIND_WORDS[kind], f"{module} (tensor {tensor})" if tensor else module


def describe(family: str, name: str, phase: str) -> str:
    """Human wording of where a value was observed, e.g. ``forward output of layers.2.mlp``."""
    if family in ("actv", "actv_grad"):
        words, module = _split_suffix(name)
        return f"{phase} {words} {module}" if words else f"{phase} {name}"
    if family == "grad_unreduced":
        return f"backward weight gradient of {name}"
    if family == "grad_reduced":
        return f"reduced weight gradient of {name}"
    if family in ("exp_avg", "exp_avg_sq", "update", "ratio", "momentum"):
        return f"optimizer {family} of {name}"
    if family == "param":
        return f"parameter {name}"
    if family == "comm":
        return f"communication {name}" if phase in ("communication", "") else f"{phase} communication {name}"
    if family == "scalars":
        return {"loss": "loss", "grad_norm": "global grad norm"}.get(name, name)
    return f"{family} {name}"


def format_number(value: float) -> str:
    """Compact number for messages: counts as whole numbers (``32768``), else 4 significant digits
    (``nan``, ``inf``, ``3.2e+04``, ``0.125``)."""
    if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"


def event_summary(event: AnomalyEvent | dict[str, Any]) -> str:
    """``step 5, micro-step 0, rank 1: forward output of layers.2.mlp``."""
    data = event.to_dict() if isinstance(event, AnomalyEvent) else event
    where = describe(data["family"], data["name"], data["phase"])
    return f"step {data['step']}, micro-step {data['micro_step']}, rank {data['rank']}: {where}"
