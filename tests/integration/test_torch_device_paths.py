"""The float64-reference tests of a plain torch run, again on the device path (what CUDA and Ascend
run): with the fused kernels and with plain torch ops. Plus a bfloat16 AdamW run, whose tensors take
the device path anyway, and the one-transfer-per-step check on both paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.integration.test_torch_families import (  # noqa: F401 - collected again under the fixture below
    test_bf16_global_grad_norm_accumulates_in_float32,
    test_bf16_statistics_accumulate_in_float32,
    test_every_family_matches_numpy,
    test_gradient_accumulation_rows_per_micro_step,
    test_gradient_rows_are_named_by_tuple_position,
    test_in_place_relu_trains_and_output_grads_match_float64,
    test_tuple_list_and_kwargs_tensors_are_each_measured,
)
from tests.integration.test_torch_lifecycle import (  # noqa: F401
    test_one_host_transfer_per_collected_step_and_none_otherwise,
)
from tests.models import TinyNet, batch, loss_fn
from tests.reference import METRICS, assert_close, np_stats, read_family
from trainmon import TrainerMonitor
from trainmon.collect import stats


@pytest.fixture(autouse=True, params=["fused", "torch"])
def device_path(request, monkeypatch):
    """Every CPU tensor takes the device path; ``torch``: without the fused kernels."""
    monkeypatch.setattr(stats, "_NUMPY_VIEWABLE", ())
    if request.param == "torch":
        monkeypatch.setattr(stats, "fused_enabled", False)
    return request.param


def test_bf16_adamw_families_match_float64(tmp_path):
    torch.manual_seed(0)
    model = TinyNet().to(torch.bfloat16)
    with torch.no_grad():
        model.layers[0].fc1.bias.zero_()  # exact zeros: the ratio's param == 0 rule
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    config = {"output_dir": str(tmp_path), "run_name": "run", "sinks": ["csv"], "params": {"enabled": True},
              "weight_grads": {"metrics": METRICS}, "optimizer_states": {"metrics": METRICS}}
    ref: dict[tuple[str, str, int], np.ndarray] = {}
    with TrainerMonitor(config) as monitor:
        monitor.attach(model, optimizer)
        for step in range(3):
            loss_fn(model, *batch(step)).float().backward()
            for name, p in model.named_parameters():
                ref[("grad", name, step)] = p.grad.double().numpy().copy()
                ref[("param", name, step)] = p.detach().double().numpy().copy()
            optimizer.step()
            for name, p in model.named_parameters():
                state = optimizer.state[p]
                m, v = state["exp_avg"].double().numpy(), state["exp_avg_sq"].double().numpy()
                ref[("exp_avg", name, step)], ref[("exp_avg_sq", name, step)] = m.copy(), v.copy()
                update = (m / (1 - 0.9 ** (step + 1))) / (np.sqrt(v / (1 - 0.999 ** (step + 1))) + 1e-8)
                pnp = p.detach().double().numpy()
                ref[("update", name, step)] = update
                ref[("ratio", name, step)] = np.where(pnp != 0, update / np.where(pnp != 0, pnp, 1), 0.0)
            optimizer.zero_grad()
            monitor.step()
    rank_dir = tmp_path / "run" / "rank0"
    for family, kind in [("grad_unreduced", "grad"), ("grad_reduced", "grad"), ("param", "param"),
                         ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("update", "update"),
                         ("ratio", "ratio")]:
        frame = read_family(rank_dir, family)
        assert len(frame) == 3 * len(list(model.parameters())), family
        for _, row in frame.iterrows():
            # bfloat16 values are exact in float64; statistics accumulate (and the update is computed) in float32
            assert_close(row, np_stats(ref[(kind, row["name"], row["step"])]), METRICS, rtol=2e-5, atol=1e-6,
                         label=f"{family} {row['name']}")
