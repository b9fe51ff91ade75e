"""The size projection (``trainmon.runtime.sizing.project``) as arithmetic: families, schedule, sinks, the line.
Its figures against a real run's files: tests/integration/test_sizing.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainmon.config import load_config
from trainmon.runtime.sizing import Measured, human_bytes, project

# the parameter names of a 7B Llama: 32 layers x 9 tensors + embeddings, final norm, head = 291
LAYER = ["input_layernorm.weight", "post_attention_layernorm.weight", *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
         *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))]
LLAMA_7B = ["model.embed_tokens.weight", *(f"model.layers.{i}.{n}" for i in range(32) for n in LAYER),
            "model.norm.weight", "lm_head.weight"]


def test_the_7b_shape_with_the_former_default_config():
    """Issue 31: with the former defaults (CSV, and a TensorBoard tag per tensor), ~1.0 MB per collected step per
    rank, ~650 GB for 10,000 steps x 64 ranks; the default now (the store and TensorBoard's overview) is ~35 kB."""
    config = load_config({"sinks": ["csv", "tensorboard"], "tensorboard": {"per_tensor": True}})
    sizing = project(Measured(params=LLAMA_7B, optimizer_states=None), config, world_size=64)
    assert len(LLAMA_7B) == 291
    assert {f.family: f.rows for f in sizing.families} == {
        **{f: 291 for f in ("grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq", "update", "ratio")},
        "momentum": 0}  # an optimizer not known here keeps Adam's moments or a momentum buffer, not both
    assert not sizing.estimated
    assert sizing.bytes_per_step == pytest.approx(1.0e6, rel=0.1)
    assert sizing.bytes_per_steps(10_000) * 64 == pytest.approx(650e9, rel=0.1)
    line = sizing.line()
    assert line.startswith("trainmon: 1,746 rows per collected step (grad_unreduced 291, grad_reduced 291, ")
    assert "with sinks [csv, tensorboard] 1.0 MB per collected step per rank, 1.0 GB per 1,000 steps (x64 ranks: " \
           "67 GB)" in line
    default = project(Measured(params=LLAMA_7B, optimizer_states=None), load_config({}), world_size=64)
    store_only = project(Measured(params=LLAMA_7B, optimizer_states=None), load_config({"sinks": ["parquet"]}))
    assert store_only.bytes_per_step == 1746 * 16  # 2 + 2 per metric, 7 metrics
    assert default.bytes_per_step == store_only.bytes_per_step + default.overview_bytes
    assert "with sinks [parquet, tensorboard] 30 kB per collected step per rank" in default.line()


def test_tensorboard_overview_is_a_constant_per_step_and_per_tensor_follows_the_filter():
    """The overview's bytes do not grow with the model; per-tensor bytes count only the tensors, families and
    metrics selected."""
    small, big = (project(Measured(params=[f"layers.{i}.weight" for i in range(n)]), load_config({}))
                  for n in (3, 3000))
    assert small.overview_bytes == big.overview_bytes > 0
    # 6 families x 10 tags (7 metrics: 9 summaries and nonfinite_tensors), each its text + 10
    tags = [f"{stat}" for stat in ("norm_max", "norm_median", "norm_argmax", "min_min", "max_max", "mean_median",
                                   "zeros_max", "nans_sum", "infs_sum", "nonfinite_tensors")]
    families = ("grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq", "update", "ratio")
    assert small.overview_bytes == sum(len(f"{f}/{t}") + 10 for f in families for t in tags)
    assert {f.bytes_per_row["tensorboard"] for f in big.families} == {0.0}
    config = load_config({"weight_grads": {"metrics": ["norm", "nans"]}, "optimizer_states": {"enabled": False},
                          "tensorboard": {"per_tensor": True, "tensors": ["layers.1.*"], "families": ["grad_reduced"],
                                          "metrics": ["norm"]}})
    sizing = project(Measured(params=["layers.0.weight", "layers.1.weight"]), config)
    per_row = {f.family: f.bytes_per_row["tensorboard"] for f in sizing.families}
    assert per_row == {"grad_unreduced": 0.0, "grad_reduced": (len("grad_reduced/layers.1.weight/norm") + 10) / 2}
    overview = ["grad_reduced/norm_max", "grad_reduced/norm_median", "grad_reduced/norm_argmax",
                "grad_reduced/nonfinite_tensors"]
    assert sizing.overview_bytes == sum(len(tag) + 10 for tag in overview)


def test_the_schedule_thins_and_caps_the_steps():
    config = load_config({"step_interval": 10, "collect_times": 50, "sinks": ["parquet"]})
    sizing = project(Measured(params=["w"]), config)
    assert sizing.collected(1000) == 50 and sizing.collected(95) == 10
    per_step = 6 * 16.0  # 6 families x 1 row x 16 bytes (7 metrics)
    assert sizing.bytes_per_step == per_step and sizing.bytes_per_steps(1000) == 50 * per_step
    assert "at step_interval 10 (collect_times 50)" in sizing.line()


def test_families_follow_the_optimizer_and_the_config():
    config = load_config({"activations": {"enabled": True, "inputs": False, "metrics": ["norm"]},
                          "optimizer_states": {"states": ["exp_avg", "momentum"]}, "communication": {"enabled": True},
                          "weight_grads": {"per_micro_step": True}})
    sgd = project(Measured(params=["a", "b"], modules=["fc", "head"], optimizer_states=["momentum"]), config,
                  grad_acc_steps=4)
    rows = {f.family: f.rows for f in sgd.families}
    assert rows == {"actv": 8, "actv_grad": 8, "grad_unreduced": 8, "grad_reduced": 2, "exp_avg": 0, "momentum": 2}
    assert sgd.not_counted == ("comm",) and "comm not counted" in sgd.line()
    assert "(actv ~8, actv_grad ~8, grad_unreduced 8, grad_reduced 2, momentum 2; comm" in sgd.line()
    no_optimizer = project(Measured(params=["a", "b"], has_optimizer=False), config)
    assert {f.family: f.rows for f in no_optimizer.families if f.rows} == {"grad_unreduced": 2}


def test_bytes_per_row_per_sink():
    config = load_config({"sinks": ["csv", "tensorboard", "parquet"], "weight_grads": {"metrics": ["norm", "nans"]},
                          "optimizer_states": {"enabled": False}, "tensorboard": {"per_tensor": True}})
    (family, _) = project(Measured(params=["fc.weight"]), config).families
    # 0,fc.weight,12345,0,<20 chars>,<3 chars>\r\n
    assert family.bytes_per_row["csv"] == len("0,fc.weight,12345,0,") + 20 + 1 + 3 + 2
    tags = ["grad_unreduced/fc.weight/norm", "grad_unreduced/fc.weight/nans"]
    assert family.bytes_per_row["tensorboard"] == sum(len(tag) + 10 for tag in tags)
    assert family.bytes_per_row["parquet"] == 2 + 2 * 2


@pytest.mark.parametrize(("size", "text"), [(999, "999 B"), (1234, "1.2 kB"), (98e6, "98 MB"), (6.27e9, "6.3 GB"),
                                            (1.234e12, "1.2 TB"), (650e12, "650 TB")])
def test_human_bytes(size, text):
    assert human_bytes(size) == text


def test_the_documented_large_run_config_is_the_benchmarked_one():
    """docs/sizing.md's large-run YAML block is valid and is what benchmarks/sizing.py projects."""
    import yaml

    from benchmarks.sizing import LARGE_RUN

    text = (Path(__file__).resolve().parents[2] / "docs" / "sizing.md").read_text(encoding="utf-8")
    block = text.split("## A large-run config", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    documented = yaml.safe_load(block)
    assert documented == LARGE_RUN
    assert load_config(documented) == load_config(LARGE_RUN)
