"""The TensorBoard overview (``trainmon.sinks.tensorboard_overview``): its summaries against numpy, the same
values fed a record at a time (the sink) or as columns read back (``csv2tb``), its bound on tags."""

from __future__ import annotations

import json
import math
import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainmon.base.records import FAMILIES, METRICS, Row, RowKey, StepRecord, metrics_of
from trainmon.errors import ConfigError
from trainmon.sinks.tensorboard import TensorBoardSink, scalar_tags
from trainmon.sinks.tensorboard_overview import (
    MAX_TAGS,
    OVERVIEW_STATS,
    SCALAR_TAGS,
    Overview,
    TagSelection,
    summarise,
)

_VALUES = st.one_of(st.floats(-1e6, 1e6), st.sampled_from([math.nan, math.inf, -math.inf, 0.0]))


def _reference(column: np.ndarray, metric: str, stat: str) -> float:
    """One summary of one group by numpy's own functions (float64)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy warns for an all-NaN group; NaN is the answer
        if stat == "max":  # a NaN norm is NaN data (it propagates), another metric's NaN is an empty tensor
            return float(np.max(column) if metric == "norm" else np.nanmax(column))
        return float({"min": np.nanmin, "median": np.nanmedian, "sum": np.sum}[stat](column))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(_VALUES, min_size=1, max_size=9), min_size=1, max_size=6))
def test_summaries_are_numpys(groups: list[list[float]]) -> None:
    values = np.array([v for group in groups for v in group])
    starts = np.cumsum([0] + [len(g) for g in groups[:-1]])
    index = np.arange(len(values)) + 100
    for metric in METRICS:
        out = summarise({metric: values}, starts, index)
        for i, group in enumerate(groups):
            for stat in (stat for stat in OVERVIEW_STATS[metric] if stat != "argmax"):
                want = _reference(np.array(group), metric, stat)
                if stat == "sum":  # summed in another order than np.sum's (the counts it is for are exact)
                    np.testing.assert_allclose(out[f"{metric}_sum"][i], want, rtol=1e-12, err_msg=str(group))
                else:
                    np.testing.assert_array_equal(out[f"{metric}_{stat}"][i], want, err_msg=f"{metric}_{stat} {group}")
    out = summarise({"norm": values}, starts, index)
    for i, group in enumerate(groups):
        column = np.array(group)
        # the first NaN when there is one (np.max propagates it), else numpy's first maximum
        holder = int(np.argmax(np.isnan(column))) if np.isnan(column).any() else int(np.argmax(column))
        assert out["norm_argmax"][i] == starts[i] + holder + 100
        assert out["nonfinite_tensors"][i] == float((~np.isfinite(column)).sum())


def test_an_empty_tensor_is_no_value_and_a_nan_norm_is_one():
    """An empty tensor (a MoE expert without tokens) has norm 0 and NaN min/max/mean/zeros: skipped, not flagged."""
    empty = {"norm": 0.0, "min": math.nan, "max": math.nan, "mean": math.nan, "zeros": math.nan, "nans": 0.0,
             "infs": 0.0}
    full = {"norm": 2.0, "min": -1.0, "max": 1.5, "mean": 0.25, "zeros": 0.5, "nans": 0.0, "infs": 0.0}
    rows = [Row(RowKey("actv", name, 0, 0, i), 0, values, False) for i, (name, values) in
            enumerate([("expert0.output", empty), ("expert1.output", full)])]
    ((_, values, texts),) = Overview().record_blocks(0, rows)
    assert values == {"actv/norm_max": 2.0, "actv/norm_median": 1.0, "actv/norm_argmax": 1.0, "actv/min_min": -1.0,
                      "actv/max_max": 1.5, "actv/mean_median": 0.25, "actv/zeros_max": 0.5, "actv/nans_sum": 0.0,
                      "actv/infs_sum": 0.0, "actv/nonfinite_tensors": 0.0}
    assert "| 1 | expert1.output |" in texts["actv/tensors"]


def _records(seed: int, steps: int = 6) -> list[StepRecord]:
    """Random steps of two families: tensors that come and go (a table that grows), micro-steps, VPP chunks,
    NaN and Inf, and a family whose metrics change at step 3 (as a dynamic config does)."""
    rng = np.random.default_rng(seed)
    records = []
    for step in range(steps):
        rows = []
        for family in ("actv", "grad_reduced"):
            metrics = METRICS if family == "actv" or step < 3 else ["norm", "nans"]
            for i in range(int(rng.integers(1, 3 + 2 * step))):
                values = {m: float(rng.choice([rng.normal(), math.nan, math.inf], p=[0.8, 0.1, 0.1]))
                          for m in metrics}
                key = RowKey(family, f"layers.{i}.x", int(rng.integers(0, 2)), int(rng.integers(0, 2)), i)
                rows.append(Row(key, step, values, False))
        records.append(StepRecord(step=step, rank=0, rows=rows))
    return records


def _columns(records: list[StepRecord], family: str, piece: int) -> list[dict[str, Any]]:
    """``family``'s rows as csv2tb reads them back: per metric list, in pieces of ``piece`` rows with row ids of
    their own (a step may span two pieces: joined first, as csv2tb does)."""
    rows = [row for record in records for row in record.rows if row.family == family]
    runs: list[list[Row]] = []  # rows of one list of metrics (a CSV file, a group of store parts)
    for row in rows:
        if not runs or list(runs[-1][-1].values) != list(row.values):
            runs.append([])
        runs[-1].append(row)
    tables = []
    for part in (run[start:start + piece] for run in runs for start in range(0, len(run), piece)):
        keys: dict[tuple[int, str], int] = {}
        ids = [keys.setdefault((r.key.vpp_stage, r.name), len(keys)) for r in part]
        tables.append({"metrics": list(part[0].values), "keys": list(keys), "rows": np.array(ids),
                       "micro": np.array([r.key.micro_step for r in part]), "steps": np.array([r.step for r in part]),
                       "values": np.array([list(r.values.values()) for r in part])})
    return tables


@pytest.mark.parametrize("seed", range(4))
def test_the_sink_and_csv2tb_compute_the_same_overview(seed):
    from trainmon.tools.csv2tb_sources import complete_steps
    from trainmon.tools.readers import Table

    records = _records(seed)
    live = Overview()
    expected = [block for record in records for block in live.record_blocks(record.step, record.rows)]
    expected += live.finish()
    offline = Overview()
    got = []
    for family in ("actv", "grad_reduced"):
        pieces = [Table(family, t["metrics"], t["keys"], t["rows"], t["steps"], t["micro"], t["values"])
                  for t in _columns(records, family, piece=3)]
        for table in complete_steps(iter(pieces)):
            got += offline.blocks(family, table.metrics, table.keys, table.rows, table.micro_steps, table.steps,
                                  table.values)
    got += offline.finish()

    def canonical(blocks: list[Any]) -> list[str]:
        return sorted(json.dumps([step, {k: str(v) for k, v in values.items()}, texts])
                      for step, values, texts in blocks)

    assert canonical(got) == canonical(expected)
    assert any(texts for _, _, texts in expected)


def test_scalars_in_the_overview():
    dropped: list[str] = []
    overview = Overview(on_dropped=dropped.append)
    assert overview.scalar_tags("loss", scalar_tags) == ["0_overview/loss", "scalars/loss"]
    assert overview.scalar_tags("lr/group3", scalar_tags) == ["0_overview/lr/group3", "scalars/lr/group3"]
    assert overview.scalar_tags("lr/group4", scalar_tags) == []  # with per_tensor: every group
    assert overview.scalar_tags("grad_probe/fc.weight/cos_prev", scalar_tags) == []  # per tensor
    assert overview.scalar_tags("grad_probe/cos_prev", scalar_tags) == ["scalars/grad_probe/cos_prev"]
    kept = [name for name in (f"user{i}" for i in range(100)) if overview.scalar_tags(name, scalar_tags)]
    assert len(kept) == SCALAR_TAGS - 2 - 1  # lr/group3's two tags and cos_prev count, loss does not
    assert dropped == [f"user{len(kept)}"] and len(overview.dropped) == 100 - len(kept)
    assert overview.scalar_tags("grad_norm", scalar_tags) == ["0_overview/grad_norm", "scalars/grad_norm"]
    detail = Overview(TagSelection(per_tensor=True, tensors=["fc.*"]))
    assert detail.scalar_tags("lr/group4", scalar_tags) == ["0_overview/lr/group4", "scalars/lr/group4"]
    assert detail.scalar_tags("grad_probe/fc.weight/cos_prev", scalar_tags) == ["scalars/grad_probe/fc.weight/cos_prev"]
    assert detail.scalar_tags("grad_probe/head.weight/cos_prev", scalar_tags) == []
    assert all(detail.scalar_tags(f"user{i}", scalar_tags) for i in range(100))


def test_selection():
    selection = TagSelection(per_tensor=True, tensors=["re:^layers\\.0\\.", "head.weight"], families=["actv"],
                             metrics=["norm", "max"])
    assert selection.tensor_tag("actv", "layers.0.fc.output", "max")
    assert not selection.tensor_tag("actv", "layers.1.fc.output", "max")
    assert not selection.tensor_tag("grad_reduced", "head.weight", "norm")
    assert not selection.tensor_tag("actv", "head.weight", "mean")
    assert not TagSelection(tensors=["*"]).tensor("anything")  # per_tensor off
    with pytest.raises(ConfigError, match=r"tensorboard.tensors\[1\]: invalid regex"):
        TagSelection(per_tensor=True, tensors=["a", "re:("])


def test_every_family_metric_and_bounded_scalar_at_once_stays_under_200_tags(tmp_path, caplog):
    """The worst case: every family and metric, 1,000 tensors with micro-steps and VPP chunks, 300 parameter groups,
    per-parameter grad-probe scalars, 100 scalars of the user's, events of every detector type."""
    sink = TensorBoardSink(tmp_path)
    rng = np.random.default_rng(0)
    detectors = ("nonfinite", "spike", "loss_spike")
    for step in range(3):
        rows = [Row(RowKey(family, f"layers.{i}.w", i % 2, i % 3, i), step,
                    {m: float(rng.normal()) for m in metrics_of(family)}, False)
                for family in FAMILIES for i in range(1000)]
        scalars = {"loss": 1.0, "grad_norm": 2.0, "loss_scale": 4.0, "step_skipped": 0.0,
                   **{f"lr/group{i}": 1e-3 for i in range(300)}, **{f"loss/micro{m}": 1.0 for m in range(8)},
                   **{f"grad_probe/layers.{i}.w/cos_prev": 0.5 for i in range(1000)},
                   **{f"user/{i}": float(i) for i in range(100)}}
        sink.write(StepRecord(step=step, rank=0, rows=rows, scalars=scalars))
        with open(tmp_path / "anomalies.jsonl", "a") as handle:
            handle.writelines(json.dumps({"step": step, "detector": d, "message": "x"}) + "\n" for d in detectors)
    sink.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    tags = events.Tags()["scalars"] + events.Tags()["tensors"]
    assert len(tags) <= MAX_TAGS < 200, len(tags)
    assert sum("overview writes at most 40 scalar tags; 'user/" in r.getMessage() for r in caplog.records) == 1
    table = events.Tensors("grad_reduced/tensors/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert len(table.splitlines()) == 4 + 1000  # a title, a blank line, the header and its rule, the tensors
