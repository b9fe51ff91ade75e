"""The ``precursors`` family's host side (docs/precursors.md): its values from combined sums, exact under sharding
(shards' partials combined as any family's), rows joined with their tails, the config and the detector series."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.reference import precursors_np
from trainmon.base.precursors import PRECURSOR_METRICS, PRECURSORS, PRECURSORS_TAIL, finalize_precursors
from trainmon.base.records import RowKey, build_record, combine_partials
from trainmon.collect.adam import precursor_partials
from trainmon.config import ConfigError, family_metrics, load_config


def _adam(n: int = 5000, seed: int = 0) -> tuple[torch.nn.Parameter, dict, dict]:
    torch.manual_seed(seed)
    param = torch.nn.Parameter(torch.randn(n))
    optimizer = torch.optim.AdamW([param], lr=3e-3, eps=1e-3)  # a large eps: some elements under it
    for _ in range(4):
        param.grad = torch.randn(n) * torch.linspace(0, 1, n) ** 4  # small gradients at the start
        optimizer.step()
    return param, optimizer.state[param], optimizer.param_groups[0]


def _values(partial: np.ndarray) -> dict[str, float]:
    values, _ = finalize_precursors(partial[None, :8], partial[None, 8:])
    return {metric: values[metric][0] for metric in PRECURSOR_METRICS}


@pytest.mark.parametrize("cuts", [[0, 2500, 5000], [0, 1, 4000, 4999, 5000], [0, 0, 5000]])
def test_shards_combine_to_the_whole_parameter(cuts):
    """Shards of a parameter (as FSDP2, ZeRO and the distributed optimizer cut them, an empty one too) measured
    apart and combined with the generic combination equal float64 of the whole."""
    param, state, group = _adam()
    grad = param.grad
    heads, tails = [], []
    for start, stop in zip(cuts, cuts[1:]):
        piece = {"exp_avg": state["exp_avg"][start:stop], "exp_avg_sq": state["exp_avg_sq"][start:stop],
                 "step": state["step"]}
        partial, = precursor_partials([(param.detach()[start:stop], piece, group)], [grad[start:stop]])
        assert partial is not None
        heads.append(partial[:8].numpy())
        tails.append(partial[8:].numpy())
    head = combine_partials(np.array(heads)[:, None, :])[0]
    tail = combine_partials(np.array(tails)[:, None, :])[0]
    values = _values(np.concatenate([head, tail]))
    want = precursors_np(grad.numpy(), state["exp_avg"].numpy(), state["exp_avg_sq"].numpy(), param.detach().numpy(),
                         float(state["step"]), group["betas"], group["eps"], group["lr"])
    assert 0 < want["eps_underflow"] < 1
    for metric, value in want.items():
        assert math.isclose(values[metric], value, rel_tol=1e-5, abs_tol=1e-9), (metric, values[metric], value)


def test_conventions_zero_vectors_empty_rows_and_non_finite_sums():
    count = 4.0
    zero_param = [1.0, 0.5, 0.0, 1.0, 0.0, 1.0, 0.0, count], [0.0, 1e-3 * count, 0.0, 0.0, 1.0, 0.0, 0.0, count]
    values, nonfinite = finalize_precursors([zero_param[0]], [zero_param[1]])
    assert values["update_weight_ratio"] == [0.0]  # |p| = 0: 0, as the ratio family's rule
    assert values["cos_m_g"] == [0.0]  # |m| = 0: a cosine of a zero vector is 0
    assert values["cos_update_grad"] == [0.5] and nonfinite == [False]
    empty, flags = finalize_precursors([[0.0] * 8], [[0.0] * 8])
    assert all(math.isnan(empty[metric][0]) for metric in PRECURSOR_METRICS) and flags == [False]
    nan_head = [math.nan, math.nan, 0.0, 1.0, 0.5, 2.0, 0.0, count]
    values, nonfinite = finalize_precursors([nan_head], [zero_param[1]])
    assert nonfinite == [True] and math.isnan(values["cos_update_grad"][0]) and values["g2_v_max"] == [1.0]
    no_lr = [2.0, 1.0, 0.0, 1.0, 0.5, 2.0, 0.0, count], [1.0, math.nan, 0.0, 0.0, 1.0, 1.0, 0.0, count]
    values, nonfinite = finalize_precursors([no_lr[0]], [no_lr[1]])  # a group without lr: the ratio only is NaN
    assert math.isnan(values["update_weight_ratio"][0]) and nonfinite == [False] and values["cos_m_g"] == [0.5]
    rounded = [1.0, 1.0000001, 0.0, 1.0, 0.0, 0.0, 0.0, count], [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, count]
    assert finalize_precursors([rounded[0]], [rounded[1]])[0]["cos_update_grad"] == [1.0]  # clipped to [-1, 1]


def test_rows_are_joined_with_their_tails_and_other_rows_kept():
    head, tail = [2.0, 2.0, 0.0, 1.0, 1.0, 2.0, 1.0, 4.0], [4.0, 0.004, 0.0, 0.0, 4.0, 1.0, 0.0, 4.0]
    keys = [RowKey(PRECURSORS, "a", 0, 0, 5), RowKey("update", "a", 0, 0, 6), RowKey(PRECURSORS, "b", 0, 1, 7),
            RowKey(PRECURSORS_TAIL, "b", 0, 1, 7), RowKey(PRECURSORS_TAIL, "a", 0, 0, 5)]
    partials = np.array([head, [3.0, 1.0, -1.0, 2.0, 0.0, 0.0, 0.0, 2.0], head, tail, tail])
    metrics = {PRECURSORS: list(PRECURSOR_METRICS), "update": ["norm", "max"]}
    record = build_record(3, 0, 0, keys, partials, {}, metrics)
    assert [(row.family, row.name, row.key.vpp_stage) for row in record.rows] == [
        (PRECURSORS, "a", 0), ("update", "a", 0), (PRECURSORS, "b", 1)]
    assert record.rows[0].values["update_weight_ratio"] == 0.0005 and record.rows[2].values["cos_m_g"] == 0.5
    assert record.rows[1].values == {"norm": 3.0, "max": 2.0}
    missing = build_record(3, 0, 0, keys[:1], partials[:1], {}, metrics)  # a tail lost: NaN, not a wrong value
    (row,) = missing.rows
    assert all(math.isnan(row.values[m]) for m in ("update_weight_ratio", "cos_update_grad", "cos_m_g"))
    assert row.values["g2_v_max"] == 1.0 and not row.nonfinite


def test_config_switch_and_detector_series():
    assert PRECURSORS not in family_metrics(load_config({}))
    assert family_metrics(load_config({"optimizer_states": {"precursors": True}}))[PRECURSORS] == list(
        PRECURSOR_METRICS)
    assert PRECURSORS not in family_metrics(load_config({"optimizer_states": {"enabled": False, "precursors": True}}))
    load_config({"anomaly": {"detectors": [{"type": "spike", "series": ["precursors/layers.*/update_weight_ratio"]}]}})
    with pytest.raises(ConfigError, match=r"anomaly.detectors\[0\].series\[0\].*metric of precursors in "
                                          r"\['update_weight_ratio'"):
        load_config({"anomaly": {"detectors": [{"type": "spike", "series": ["precursors/*/norm"]}]}})
    with pytest.raises(ConfigError, match="optimizer_states.precursors"):
        load_config({"optimizer_states": {"precursors": "yes"}})
    load_config({"tensorboard": {"metrics": ["norm", "g2_v_rms"]}})
