"""Grad probe under DeepSpeed in one process (gloo, CPU): ZeRO 0/1/2/3 summaries and direction files
equal those of a plain torch run of the same model, data and optimizer, and ``grad-compare`` of the two
runs gives similarity 1.0.

Each DeepSpeed case trains in a process of its own (``tests/launch.py``); this file is also the script
those processes run (``python test_grad_probe_deepspeed.py OUT CASE_JSON``). DeepSpeed's full-gather
accessor ``safe_get_full_grad`` is made to raise there: the probe must read the local gradient.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

STEPS = 3
BOUNDS = [-0.01, 0.0, 0.01]
STATS = ["max", "min", "norm", "sign_agree_prev", "cos_prev", "sign_agree_exp_avg", "cos_exp_avg",
         "(-inf, -0.01]", "(-0.01, 0]", "(0, 0.01]", "(0.01, inf)", "zero_fraction"]
CASES = [{"name": f"z{stage}", "stage": stage} for stage in range(4)]
CASES_GAS = [{"name": f"z{stage}_gas2", "stage": stage, "gas": 2} for stage in (0, 2, 3)]
CASES_BF16 = [{"name": f"z{stage}_bf16", "stage": stage, "bf16": True} for stage in (0, 2, 3)]


def _config(out: Path, name: str) -> dict:
    return {"output_dir": str(out), "run_name": name, "sinks": ["csv"], "weight_grads": {"enabled": False},
            "optimizer_states": {"enabled": False},
            "grad_probe": {"enabled": True, "level": "L2", "bounds": BOUNDS, "scalars": "param"}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 3))  # 13, 39: sizes not multiples of 8


def _data(batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return torch.randn(STEPS, batch, 8, generator=generator), torch.randn(STEPS, batch, 3, generator=generator)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)


def _train_torch(out: Path, name: str, batch: int = 4) -> None:
    from trainmon import TrainerMonitor

    model = _model()
    optimizer = _optimizer(model)
    x, y = _data(batch)
    with TrainerMonitor(_config(out, name)).attach(model, optimizer) as monitor:
        for step in range(STEPS):
            nn.functional.mse_loss(model(x[step]), y[step]).backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()


def _train_deepspeed(out: Path, case: dict) -> None:
    """The case's process: one DeepSpeed rank, writes ``OUT/<name>/rank0/grad_probe``."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.utils

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip the slow JIT build (ENV.md)

    def _refuse(*args, **kwargs):
        raise AssertionError("the grad probe must not gather full gradients")

    deepspeed.utils.safe_get_full_grad = _refuse
    from trainmon import TrainerMonitor
    from trainmon.errors import ConfigError

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = _model()
    # gradient_clipping: DeepSpeed clips at 1.0 by default; the torch run does not clip
    gas = case.get("gas", 1)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": case["stage"]}, "bf16": {"enabled": bool(case.get("bf16"))}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=_optimizer(model), config=config)
    # rank r, micro-step i trains on rows 4 * (gas * r + i) + 0..3: the gradient DeepSpeed steps with
    # (averaged over ranks, accumulated with the loss scaled by 1/gas) is the whole batch's
    x, y = _data(4 * world * gas)
    if case.get("bf16"):
        x, y = x.bfloat16(), y.bfloat16()
    x, y = x[:, 4 * gas * rank:4 * gas * (rank + 1)], y[:, 4 * gas * rank:4 * gas * (rank + 1)]
    hooks_before = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    try:
        monitor = TrainerMonitor(_config(out, case["name"])).attach(engine)
    except ConfigError as exc:  # ZeRO 1/2/3 with more than one data-parallel rank
        (out / case["name"]).mkdir(parents=True, exist_ok=True)
        hooks_after = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
        hooked = "step" in engine.__dict__ or hooks_after != hooks_before
        (out / case["name"] / f"refused_rank{rank}.txt").write_text(str(exc) + ("\nHOOKED" if hooked else ""))
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        return
    for step in range(STEPS):
        for micro in range(gas):
            rows = slice(4 * micro, 4 * micro + 4)
            loss = nn.functional.mse_loss(engine(x[step, rows]), y[step, rows])
            engine.backward(loss)
            engine.step()
            monitor.step(loss=loss)
    monitor.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _train_deepspeed(Path(sys.argv[1]), json.loads(sys.argv[2]))


pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.launch import DeepSpeedCases

    out = tmp_path_factory.mktemp("gp_ds")
    cases = DeepSpeedCases(Path(__file__).resolve(), CASES + CASES_GAS + CASES_BF16, out, world_size=1)
    _train_torch(out, "torch")
    _train_torch(out, "torch8", batch=8)
    yield out, cases
    cases.close()


def _summary(run: Path) -> pd.DataFrame:
    table = pd.read_csv(run / "rank0" / "grad_probe" / "grad_summary.csv", keep_default_na=False, na_values=["nan"])
    return table.set_index(["name", "step"]).sort_index()


@pytest.mark.parametrize("case", [c["name"] for c in CASES + CASES_GAS])
def test_deepspeed_probe_equals_torch(runs, case, capsys):
    from trainmon.cli import main as cli_main

    out, cases = runs
    run = cases[case]
    reference = out / ("torch8" if case.endswith("_gas2") else "torch")
    want, got = _summary(reference), _summary(run)
    assert list(got.index) == list(want.index) and len(got) == 4 * STEPS
    assert (got["shape"] == want["shape"]).all() and (got["numel"] == want["numel"]).all()
    for column in STATS:
        assert column in got.columns, column
        np.testing.assert_allclose(got[column].to_numpy(float), want[column].to_numpy(float), rtol=1e-5, atol=1e-7,
                                   equal_nan=True, err_msg=f"{case} {column}")
    # in-run similarities exist where they should: exp_avg from step 1 on, prev from step 1 on
    later = got.xs(1, level="step")
    assert later[["sign_agree_prev", "sign_agree_exp_avg", "cos_exp_avg"]].notna().all().all()
    compare = out / f"cmp_{case}"
    assert cli_main(["grad-compare", str(reference), str(run), "-o", str(compare), "--no-plots"]) == 0
    sims = pd.read_csv(compare / "similarities.csv")
    params = sims[sims["kind"] == "param"]
    assert len(params) == 4 * STEPS and (sims["similarity"] == 1.0).all()
    assert not (compare / "problems.txt").exists()
    scalars = pd.read_csv(run / "rank0" / "scalars.csv")
    assert "grad_probe/sign_agree_exp_avg" in set(scalars["name"])
    capsys.readouterr()


CASES_2 = [{"name": "z0_2r", "stage": 0}, {"name": "z1_2r", "stage": 1}]


@pytest.fixture(scope="module")
def runs2(tmp_path_factory):
    from tests.launch import DeepSpeedCases

    out = tmp_path_factory.mktemp("gp_ds2")
    cases = DeepSpeedCases(Path(__file__).resolve(), CASES_2, out, world_size=2)
    _train_torch(out, "torch8", batch=8)
    yield out, cases
    cases.close()


def test_two_ranks_zero0_probe_is_the_whole_batch_gradient(runs2, capsys):
    """ZeRO-0 on 2 ranks, 4 rows each: every rank's probe equals a torch run on all 8 rows."""
    from trainmon.cli import main as cli_main

    out, cases = runs2
    run = cases["z0_2r"]
    want = _summary(out / "torch8")
    for rank in (0, 1):
        got = pd.read_csv(run / f"rank{rank}" / "grad_probe" / "grad_summary.csv", keep_default_na=False,
                          na_values=["nan"]).set_index(["name", "step"]).sort_index()
        assert list(got.index) == list(want.index)
        for column in STATS:
            np.testing.assert_allclose(got[column].to_numpy(float), want[column].to_numpy(float), rtol=1e-5,
                                       atol=1e-6, equal_nan=True, err_msg=f"rank {rank} {column}")
    compare = out / "cmp_2r"
    assert cli_main(["grad-compare", str(run), str(run), "-o", str(compare), "--no-plots"]) == 0
    sims = pd.read_csv(compare / "similarities.csv")
    assert set(sims.loc[sims["kind"] == "param", "rank"]) == {0, 1} and (sims["similarity"] == 1.0).all()
    capsys.readouterr()


def test_two_ranks_zero1_is_refused_at_attach_with_the_reason(runs2):
    _, cases = runs2
    run = cases["z1_2r"]
    for rank in (0, 1):
        message = (run / f"refused_rank{rank}.txt").read_text()
        assert "ZeRO stage 1" in message and "2 data-parallel ranks" in message and "sign bits" in message
        assert "HOOKED" not in message  # refused before the engine or a module was hooked
    assert not (run / "rank0" / "grad_probe").exists()


@pytest.mark.parametrize("case", [c["name"] for c in CASES_BF16])
def test_bf16_probe_reads_the_bf16_gradient(runs, case):
    """bf16 (DeepSpeed's BF16 optimizer under ZeRO-0, ZeRO 2/3): the probe reads the bf16 gradient of
    the step; at step 0 (same weights, rounded to bf16) it agrees with the fp32 torch run at bf16 precision."""
    out, cases = runs
    got, want = _summary(cases[case]), _summary(out / "torch")
    assert list(got.index) == list(want.index)
    first = got.xs(0, level="step")
    np.testing.assert_allclose(first["norm"], want.xs(0, level="step")["norm"], rtol=3e-2)
    assert np.isfinite(got[["max", "min", "norm"]].to_numpy(float)).all()
    later = got.xs(1, level="step")
    assert later[["sign_agree_prev", "sign_agree_exp_avg", "cos_exp_avg"]].notna().all().all()
    from trainmon.probe.storage import read_direction_header

    files = sorted((cases[case] / "rank0" / "grad_probe" / "step0").glob("*.bits"))
    # ZeRO-3 keeps (and steps with) fp32 gradient partitions; ZeRO-0's BF16 optimizer and ZeRO-2 bf16 ones
    dtype = "float32" if case.startswith("z3") else "bfloat16"
    assert len(files) == 4 and {read_direction_header(f).header["dtype"] for f in files} == {dtype}
