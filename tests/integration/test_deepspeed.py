"""DeepSpeed in one process (gloo, CPU): activations under ZeRO-3, bf16 under ZeRO 0/2/3, fp16
loss scaling, the engine's scalars, lifecycle.

Each case trains in a process of its own, on first use by a test (``tests/launch.py``), so a case that
fails (or cannot run on this CPU) fails or skips only the tests that read it. The script also checks
that ``close()`` twice leaves no module/parameter hook and no engine wrapper behind, and calls
``monitor.step(loss=loss)`` after every ``engine.step()``.

fp16 runs with DeepSpeed 0.19.8 only where oneDNN supports fp16 on the CPU (its CPU accelerator refuses
it elsewhere: AMD EPYC machines, for one); the fp16 tests skip by that capability check. There, fp16 works
under ZeRO 1-3, whose ``DeepSpeedZeroOptimizer`` checks for overflow and scales dynamically. The
fp16 case is ZeRO-1: an initial loss scale of 2**16 overflows fp16 gradients on the first step (which
DeepSpeed skips and halves the scale; ``hysteresis: 1`` makes it halve at once), and 2**15 no longer
does. (ZeRO-0 fp16 on CPU runs DeepSpeed's unfused wrapper, which found no overflow at any scale here,
so it cannot show a skipped step.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.launch import ROOT, DeepSpeedCases
from tests.reference import read_family

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "distributed" / "scripts" / "ds_train.py"
METRICS = ["norm", "min", "max", "mean", "zeros", "nans", "infs"]
CASES = [
    {"name": "z0", "stage": 0, "activations": True},
    {"name": "z3", "stage": 3, "activations": True},
    {"name": "z0_bf16", "stage": 0, "dtype": "bf16"},
    {"name": "z2_bf16", "stage": 2, "dtype": "bf16"},
    {"name": "z3_bf16", "stage": 3, "dtype": "bf16", "gas": 2},
    {"name": "z1_fp16", "stage": 1, "dtype": "fp16", "gas": 2, "scale_power": 16},
]
INITIAL_SCALE = 2.0 ** 16


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Iterator[DeepSpeedCases]:
    """``runs[name]``: the case's output directory, trained (once, in its own process) on first use."""
    cases = DeepSpeedCases(SCRIPT, CASES, tmp_path_factory.mktemp("ds1"), world_size=1)
    yield cases
    cases.close()


def _table(run: Path, family: str) -> pd.DataFrame:
    return read_family(run / "rank0", family).set_index(["name", "step", "micro_step"]).sort_index()


def test_activations_under_zero3_equal_zero0(runs):
    """ZeRO-3 materialises parameters only inside forward; module hooks still see the real tensors."""
    for family in ("actv", "actv_grad"):
        want, got = _table(runs["z0"], family), _table(runs["z3"], family)
        assert len(want) > 30 and list(got.index) == list(want.index), family
        for metric in METRICS:
            atol = 1e-7 * want["norm"].to_numpy() if metric == "mean" else 1e-7
            ok = np.isclose(got[metric], want[metric], rtol=1e-5, atol=0) | (np.abs(got[metric] - want[metric]) <= atol)
            assert ok.all(), (family, metric, list(got.index[~ok])[:3])
    assert "layers.0.fc1.output" in {name for name, *_ in _table(runs["z3"], "actv").index}


@pytest.mark.parametrize("run", ["z2_bf16"])
def test_bf16_shards_match_zero0_at_bf16_precision(runs, run):
    # step 0 only: later bf16 trajectories drift apart (ZeRO-0 bf16 and ZeRO-2 round masters differently)
    for family in ("grad_reduced", "exp_avg", "exp_avg_sq", "param"):
        want = _table(runs["z0_bf16"], family).loc[(slice(None), 0), :]
        got = _table(runs[run], family).loc[(slice(None), 0), :]
        assert list(got.index) == list(want.index), family
        np.testing.assert_allclose(got["norm"], want["norm"], rtol=2e-2, err_msg=family)
        np.testing.assert_allclose(got["max"], want["max"], rtol=3e-2, atol=1e-3, err_msg=family)


def test_bf16_zero3_with_accumulation_counts_engine_steps(runs):
    run = runs["z3_bf16"]
    scalars = pd.read_csv(run / "rank0" / "scalars.csv")
    assert scalars.loc[scalars["name"] == "global_steps", "value"].tolist() == [1.0, 2.0, 3.0]
    grads = read_family(run / "rank0", "grad_reduced")
    assert sorted(grads["step"].unique()) == [0, 1, 2] and (grads["micro_step"] == 1).all()
    unreduced = read_family(run / "rank0", "grad_unreduced")
    assert (unreduced["micro_step"] == 1).all()  # the last micro-step of each step
    assert np.isfinite(grads[METRICS]).all().all() and (grads["norm"] > 0).all()


def _scalars(run: Path) -> pd.DataFrame:
    """``scalars.csv`` as a (step x name) table."""
    return pd.read_csv(run / "rank0" / "scalars.csv").pivot(index="step", columns="name", values="value")


def test_fp16_overflow_drops_loss_scale_and_skips_the_step(runs):
    run = runs["z1_fp16"]
    scalars = _scalars(run)
    assert scalars["loss_scale"].tolist() == [INITIAL_SCALE / 2] * 3  # halved by the overflow of step 0
    assert scalars["skipped_steps"].tolist() == [1.0, 1.0, 1.0]  # 0 before the run: +1 on step 0 only
    assert scalars["step_applied"].tolist() == [0.0, 1.0, 1.0]
    assert scalars["global_steps"].tolist() == [1.0, 2.0, 3.0]
    assert not np.isfinite(scalars.loc[0, "grad_norm"])  # DeepSpeed reports the overflowed norm as inf
    grads = read_family(run / "rank0", "grad_reduced")
    assert (grads.loc[grads["step"] == 0, "infs"] + grads.loc[grads["step"] == 0, "nans"]).sum() > 0
    # The skipped step leaves the optimizer states as ZeRO created them (zeros); the next one moves them
    exp_avg = read_family(run / "rank0", "exp_avg")
    assert (exp_avg.loc[exp_avg["step"] == 0, "norm"] == 0).all()
    assert (exp_avg.loc[exp_avg["step"] == 1, "norm"] > 0).any()


@pytest.mark.parametrize("run,scaled", [("z0", False), ("z2_bf16", False), ("z1_fp16", True)])
def test_grad_norm_is_the_norm_of_all_reduced_gradients(runs, run, scaled):
    """grad_norm (DeepSpeed's, or ours under ZeRO-0 fp32) = sqrt(sum of grad_reduced norm^2) on an applied
    step. fp16 ``grad_reduced`` is read before DeepSpeed unscales it: divide by the step's loss scale."""
    scalars = _scalars(runs[run])
    grads = read_family(runs[run] / "rank0", "grad_reduced")
    for step in (1, 2):
        assert scalars.loc[step, "step_applied"] == 1.0
        total = np.sqrt((grads.loc[grads["step"] == step, "norm"].to_numpy(float) ** 2).sum())
        if scaled:
            total /= scalars.loc[step, "loss_scale"]
        rtol = 1e-5 if run == "z0" else 1e-3  # low precision: DeepSpeed sums squares in another order
        np.testing.assert_allclose(scalars.loc[step, "grad_norm"], total, rtol=rtol, err_msg=f"{run} step {step}")


@pytest.mark.parametrize("run", ["z3_bf16", "z1_fp16"])
def test_micro_step_losses_with_accumulation(runs, run):
    """With accumulation 2, monitor.step(loss=loss) after the first engine.step() of a step records
    ``loss/micro0``; after the boundary one, ``loss``. Values are the losses the script computed."""
    scalars = _scalars(runs[run])
    losses = json.loads((runs[run] / "extra_rank0.json").read_text())["losses"]
    np.testing.assert_allclose(scalars["loss/micro0"], [step[0] for step in losses], rtol=1e-6)
    np.testing.assert_allclose(scalars["loss"], [step[1] for step in losses], rtol=1e-6)
    assert not any(name.startswith("loss/micro1") for name in scalars.columns)


@pytest.mark.parametrize("run", [case["name"] for case in CASES])
def test_one_rank_needs_no_collective(runs, run):
    """A single data-parallel rank combines nothing: trainmon issues no collective at all."""
    counts = json.loads((runs[run] / "extra_rank0.json").read_text())["collectives"]
    assert counts == [[0, 0]] * 3
