"""A synthetic run store written with pyarrow directly (the sink's schema and file names), for the report benchmark,
the report's tests and the docs screenshot.

Writing 10^8 rows through the real ``ParquetSink`` (``benchmarks/store_scale.py``) takes about an hour on the 2-core
development machine (264,000 rows/s); this writes the same layout (``store/{family}/rank={R}/part-*.parquet`` with
the sink's columns, types, encodings and names; ``store/scalars``; ``rank{R}/anomalies.jsonl``) at a few million rows
per second, one part per rank and block of steps, as a closed run's merged parts are.

Values: per tensor a lognormal scale set by its type (the stripes of a real run: layer norms, embeddings and
projections differ by decades), a slow decay over the steps and 10% lognormal noise per step and rank. ``spikes``
multiply chosen rows at one step (on one rank or all); ``nan_at`` makes one row NaN from a step on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from trainmon.sinks.store_layout import parquet_bytes, part_name

BACKWARD = ("grad_reduced", "grad_unreduced", "actv_grad")
"""Families recorded in the backward pass (their execution order runs from the last layer to the first)."""
_TYPE_SCALE = {"embed_tokens": 3e-2, "q_proj": 2e-3, "k_proj": 2e-3, "v_proj": 6e-3, "o_proj": 5e-3,
               "gate_proj": 8e-3, "up_proj": 8e-3, "down_proj": 1e-2, "input_layernorm": 2e-5,
               "post_attention_layernorm": 3e-5, "norm": 1e-4, "lm_head": 5e-2}


def llama_names(layers: int = 32) -> list[str]:
    """The parameter names of Hugging Face ``LlamaForCausalLM`` with ``layers`` layers, in ``named_parameters()``
    order (32 layers: the 291 tensors of the 7B shape that ``benchmarks/sizing.py`` builds on the meta device)."""
    per_layer = [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    per_layer += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    per_layer += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    return (["model.embed_tokens.weight"] + [f"model.layers.{i}.{p}" for i in range(layers) for p in per_layer]
            + ["model.norm.weight", "lm_head.weight"])


@dataclass(frozen=True)
class Spike:
    """Rows whose values are multiplied by ``factor`` at ``step``.

    Attributes:
        step: the step.
        pattern: a regular expression the row names must match (``.`` for every row: a global jump).
        factor: the multiplier.
        rank: the rank (None: every rank).
        family: the family (None: every family).
    """

    step: int
    pattern: str
    factor: float = 8.0
    rank: int | None = None
    family: str | None = None


def _scale(name: str) -> float:
    for key, scale in _TYPE_SCALE.items():
        if f".{key}." in f".{name}":
            return scale
    return 1e-3


def write_store(run_dir: Path, names: Sequence[str], *, ranks: int = 1, steps: int = 100,
                families: Sequence[str] = ("grad_reduced",), metrics: Sequence[str] = ("norm", "max", "nans"),
                steps_per_part: int = 1000, spikes: Sequence[Spike] = (), nan_at: tuple[int, str, int] | None = None,
                events: bool = True, seed: int = 0) -> int:
    """Write the store of a synthetic run; returns the number of family rows written.

    Args:
        run_dir: the run directory (created; its ``store/`` and, with ``events``, ``rank{R}/anomalies.jsonl``).
        names: the row names (e.g. :func:`llama_names`).
        ranks: ranks ``0..ranks-1``.
        steps: steps ``0..steps-1``, all collected.
        families: the row families; each has ``metrics`` columns.
        steps_per_part: steps per Parquet part (per family and rank).
        spikes: values multiplied at one step.
        nan_at: ``(step, name, rank)``: that row is NaN from ``step`` on (``nans`` counts 1000 elements).
        events: write each rank's ``anomalies.jsonl`` with a ``spike`` event per spiked row and step and a
            ``nonfinite`` event per NaN row and step.
        seed: the random seed.
    """
    rng = np.random.default_rng(seed)
    count = len(names)
    base = np.array([_scale(name) for name in names]) * rng.lognormal(0, 0.3, count)
    dictionary = pa.array(list(names), pa.string())
    spiked = [(spike, np.array([re.search(spike.pattern, name) is not None for name in names])) for spike in spikes]
    nan_row = list(names).index(nan_at[1]) if nan_at is not None else -1
    written = 0
    events_of: dict[int, list[str]] = {}
    for family_index, family in enumerate(families):
        backward = family in BACKWARD
        order = (count - 1 - np.arange(count) if backward else np.arange(count)).astype(np.int32)
        phase = "backward" if backward else "forward" if family == "actv" else "optimizer"
        family_base = base * (1.0 + family_index)
        for rank in range(ranks):
            folder = run_dir / "store" / family / f"rank={rank}"
            folder.mkdir(parents=True, exist_ok=True)
            rank_base = family_base * rng.lognormal(0, 0.05, count)
            for sequence, first in enumerate(range(0, steps, steps_per_part)):
                last = min(steps, first + steps_per_part) - 1
                step_axis = np.arange(first, last + 1)
                trend = 1.0 + 2.0 * np.exp(-step_axis / max(1.0, steps / 5))
                norm = rank_base[None, :] * trend[:, None] * rng.lognormal(0, 0.1, (len(step_axis), count))
                for spike, rows in spiked:
                    if first <= spike.step <= last and spike.rank in (None, rank) and spike.family in (None, family):
                        norm[spike.step - first, rows] *= spike.factor
                        if events and family_index == 0:
                            at = spike.step - first
                            events_of.setdefault(rank, []).extend(
                                _event(rank, spike.step, family, names[int(i)], "norm", float(norm[at, i]), "spike",
                                       f"{names[int(i)]} norm jumped x{spike.factor:g}")
                                for i in np.flatnonzero(rows)[:20])
                nans = np.zeros_like(norm)
                if nan_at is not None and nan_at[2] == rank and nan_at[0] <= last:
                    start = max(0, nan_at[0] - first)
                    norm[start:, nan_row] = np.nan
                    nans[start:, nan_row] = 1000.0
                    if events and family_index == 0:
                        events_of.setdefault(rank, []).extend(
                            _event(rank, int(s), family, names[nan_row], "nans", 1000.0, "nonfinite",
                                   f"{names[nan_row]} has 1000 NaN") for s in step_axis[start:])
                values = {"norm": norm, "max": norm * 0.05, "min": -norm * 0.05, "mean": norm * 1e-4,
                          "zeros": np.zeros_like(norm), "nans": nans, "infs": np.zeros_like(norm)}
                rows = len(step_axis) * count
                indices = pa.array(np.tile(np.arange(count, dtype=np.int32), len(step_axis)))
                columns: dict[str, pa.Array] = {
                    "step": pa.array(np.repeat(step_axis, count).astype(np.int64)),
                    "micro_step": pa.array(np.zeros(rows, np.int32)),
                    "vpp_stage": pa.array(np.zeros(rows, np.int32)),
                    "pp_stage": pa.array(np.zeros(rows, np.int32)),
                    "order": pa.array(np.tile(order, len(step_axis))),
                    "phase": pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, np.int32)),
                                                            pa.array([phase])).cast(pa.string()),
                    "name": pa.DictionaryArray.from_arrays(indices, dictionary).cast(pa.string()),
                    "nonfinite": pa.array(~np.isfinite(norm).reshape(-1)),
                }
                for metric in metrics:
                    columns[metric] = pa.array(values[metric].reshape(-1))
                name = part_name(first, last, f"{rank:08x}", sequence, sequence)
                (folder / name).write_bytes(parquet_bytes(pa.table(columns)))
                written += rows
    for rank in range(ranks):
        _write_scalars(run_dir, rank, steps, base, rng)
        if events and events_of.get(rank):
            (run_dir / f"rank{rank}").mkdir(parents=True, exist_ok=True)
            (run_dir / f"rank{rank}" / "anomalies.jsonl").write_text(
                "".join(line + "\n" for line in sorted(
                    events_of[rank], key=lambda line: json.loads(line)["step"])))
    return written


def _write_scalars(run_dir: Path, rank: int, steps: int, base: np.ndarray, rng: np.random.Generator) -> None:
    folder = run_dir / "store" / "scalars" / f"rank={rank}"
    folder.mkdir(parents=True, exist_ok=True)
    step_axis = np.arange(steps)
    loss = 2.0 + 3.0 * np.exp(-step_axis / max(1.0, steps / 4)) + rng.normal(0, 0.03, steps)
    grad_norm = float(np.sqrt((base**2).sum())) * (1.0 + 2.0 * np.exp(-step_axis / max(1.0, steps / 5)))
    lr = np.minimum(1.0, (step_axis + 1) / max(1.0, steps / 20)) * 3e-4
    table = pa.table({"step": pa.array(np.repeat(step_axis, 3).astype(np.int64)),
                      "name": pa.array(["loss", "grad_norm", "lr/group0"] * steps, pa.string()),
                      "value": pa.array(np.stack([loss, grad_norm, lr], axis=1).reshape(-1))})
    (folder / part_name(0, max(0, steps - 1), f"{rank:08x}", 0, 0)).write_bytes(parquet_bytes(table))


def _event(rank: int, step: int, family: str, name: str, metric: str, value: float, detector: str, message: str) -> str:
    return json.dumps({"step": step, "micro_step": 0, "rank": rank, "phase": "backward", "pp_stage": 0, "vpp_stage": 0,
                       "order": 0, "detector": detector, "family": family, "name": name, "metric": metric,
                       "value": value, "baseline": value / 8, "message": message,
                       "time": "2026-01-01T00:00:00.000Z"})


__all__ = ["Spike", "llama_names", "write_store"]
