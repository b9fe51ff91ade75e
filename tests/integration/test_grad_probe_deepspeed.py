"""Grad probe under DeepSpeed (gloo, CPU): ZeRO 0/1/2/3 summaries and direction files equal those of a
plain torch run of the same model, data and optimizer, and ``grad-compare`` of the two runs gives
similarity 1.0; in one process, and with 2 ranks (ZeRO 1/2/3: the shards' partials and sign bits
combined) also against float64 numpy of the whole gradients DeepSpeed stepped with.

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


def _config(out: Path, name: str, level: str = "L2", sample: int | None = None, interval: int = 1) -> dict:
    return {"output_dir": str(out), "run_name": name, "sinks": ["csv"], "weight_grads": {"enabled": False},
            "step_interval": interval,
            "optimizer_states": {"enabled": False},
            "grad_probe": {"enabled": True, "level": level, "bounds": BOUNDS, "scalars": "param",
                           "sample_elements": sample}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 3))  # 13, 39: sizes not multiples of 8


def _data(batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return torch.randn(STEPS, batch, 8, generator=generator), torch.randn(STEPS, batch, 3, generator=generator)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)


def _train_torch(out: Path, name: str, batch: int = 4, **probe: object) -> None:
    from trainmon import TrainerMonitor

    model = _model()
    optimizer = _optimizer(model)
    x, y = _data(batch)
    grads = {}
    with TrainerMonitor(_config(out, name, **probe)).attach(model, optimizer) as monitor:
        for step in range(STEPS):
            nn.functional.mse_loss(model(x[step]), y[step]).backward()
            grads.update({f"{step}|{n}": p.grad.double().numpy() for n, p in model.named_parameters()})
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    np.savez(out / name / "grads.npz", **grads)


def _train_deepspeed(out: Path, case: dict) -> None:
    """The case's process: one DeepSpeed rank, writes ``OUT/<name>/rank0/grad_probe``."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.utils

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # skip the slow JIT build (ENV.md)

    def _refuse(*args, **kwargs):
        raise AssertionError("the grad probe must not gather full gradients")

    full_grad = deepspeed.utils.safe_get_full_grad  # the test's own reference (a collective), not the probe's
    deepspeed.utils.safe_get_full_grad = _refuse
    from trainmon import TrainerMonitor

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
    gathers = [0]  # the probe's one collective per collected step, counted
    gather = torch.distributed.gather

    def counting_gather(*args, **kwargs):
        gathers[0] += 1
        return gather(*args, **kwargs)

    torch.distributed.gather = counting_gather
    monitor = TrainerMonitor(_config(out, case["name"], case.get("level", "L2"), case.get("sample"),
                                     case.get("interval", 1))).attach(engine)
    grads: dict[str, np.ndarray] = {}
    for step in range(STEPS):
        for micro in range(gas):
            rows = slice(4 * micro, 4 * micro + 4)
            loss = nn.functional.mse_loss(engine(x[step, rows]), y[step, rows])
            engine.backward(loss)
            if case.get("save_grads") and engine.is_gradient_accumulation_boundary():
                # the whole gradient the step is about to use (gathered by DeepSpeed, every rank joins)
                for name, param in engine.module.named_parameters():
                    grads[f"{step}|{name}"] = full_grad(param).detach().double().numpy()
            engine.step()
            monitor.step(loss=loss)
    monitor.close()
    torch.distributed.gather = gather
    (out / case["name"] / f"gathers_rank{rank}.txt").write_text(str(gathers[0]))
    if grads and rank == 0:
        np.savez(out / case["name"] / "grads.npz", **grads)
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


def _arrays(path: Path) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file (read at once; the file is closed)."""
    with np.load(path) as data:
        return {key: data[key] for key in data.files}


def _summary(run: Path) -> pd.DataFrame:
    table = pd.read_csv(run / "rank0" / "grad_probe" / "grad_summary.csv", keep_default_na=False, na_values=["nan"])
    return table.set_index(["name", "step"]).sort_index()


@pytest.mark.parametrize("case", [c["name"] for c in CASES + CASES_GAS])
def test_deepspeed_probe_equals_torch(runs, case, capsys):
    from trainmon.tools.cli import main as cli_main

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


CASES_2 = [{"name": "z0_2r", "stage": 0}, *({"name": f"z{stage}_2r", "stage": stage, "save_grads": True}
                                            for stage in (1, 2, 3)),
           {"name": "z3_2r_l0", "stage": 3, "level": "L0", "save_grads": True},
           {"name": "z2_2r_sample", "stage": 2, "sample": 20, "save_grads": True},
           {"name": "z3_2r_interval", "stage": 3, "interval": 2}]
SAMPLE = 20


@pytest.fixture(scope="module")
def runs2(tmp_path_factory):
    from tests.launch import DeepSpeedCases

    out = tmp_path_factory.mktemp("gp_ds2")
    cases = DeepSpeedCases(Path(__file__).resolve(), CASES_2, out, world_size=2)
    _train_torch(out, "torch8", batch=8)
    _train_torch(out, "torch8_l0", batch=8, level="L0")
    _train_torch(out, "torch8_sample", batch=8, sample=SAMPLE)
    yield out, cases
    cases.close()


def test_two_ranks_zero0_probe_is_the_whole_batch_gradient(runs2, capsys):
    """ZeRO-0 on 2 ranks, 4 rows each: every rank's probe equals a torch run on all 8 rows."""
    from trainmon.tools.cli import main as cli_main

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


def _numpy_reference(grads: dict[str, np.ndarray], sample: int | None = None) -> dict[tuple[str, int], dict]:
    """float64 numpy of the whole gradients DeepSpeed stepped with: every summary column and the bits.

    ``exp_avg`` as the step finds it is recomputed from the gradients (Adam, beta1 0.9, from 0;
    none before the first step)."""
    from trainmon.probe.device import sample_indices

    out: dict[tuple[str, int], dict] = {}
    momentum: dict[str, np.ndarray] = {}
    previous: dict[str, np.ndarray] = {}
    for step in range(STEPS):
        for key in [k for k in list(grads) if k.startswith(f"{step}|")]:
            name, g = key.split("|", 1)[1], grads[key].ravel()
            edges = [-np.inf, *BOUNDS, np.inf]
            row = {"max": g.max(), "min": g.min(), "norm": np.sqrt(np.sum(g * g)), "zero_fraction": np.mean(g == 0),
                   **{f"({lo:g}, {hi:g}{')' if hi == np.inf else ']'}": np.mean((g > lo) & (g <= hi))
                      for lo, hi in zip(edges[:-1], edges[1:])}}
            if sample is None or sample >= g.size:
                stored = g
            else:
                stored = g[sample_indices(g.size, sample, torch.device("cpu")).numpy()]
            row["sign_agree_prev"] = np.mean((stored > 0) == (previous[name] > 0)) if name in previous else np.nan
            m = momentum.get(name)
            row["sign_agree_exp_avg"] = np.mean((g > 0) == (m > 0)) if m is not None else np.nan
            row["cos_exp_avg"] = g @ m / np.sqrt((g @ g) * (m @ m)) if m is not None else np.nan
            row["bits"] = np.packbits(stored > 0, bitorder="little")
            row["grad"] = g
            out[(name, step)] = row
            previous[name] = stored
            momentum[name] = 0.9 * (m if m is not None else 0.0) + 0.1 * g
    return out


def _bits(run: Path, step: int, name: str) -> np.ndarray:
    from trainmon.probe.storage import read_direction_header

    (path,) = [p for p in (run / "rank0" / "grad_probe" / f"step{step}").glob("*.bits")
               if read_direction_header(p).header["name"] == name]
    return read_direction_header(path).bits()


@pytest.mark.parametrize("case", ["z1_2r", "z2_2r", "z3_2r", "z2_2r_sample"])
def test_two_ranks_zero_shards_combine_to_the_whole_gradient(runs2, case, capsys):
    """ZeRO 1/2/3 on 2 ranks (4 rows each): the probe of the shards equals float64 numpy of the whole
    gradient DeepSpeed stepped with (gathered by the test script), equals the unsharded torch run on all
    8 rows, is written once (by rank 0), and grad-compare against the torch run gives 1.0 everywhere."""
    from trainmon.tools.cli import main as cli_main

    out, cases = runs2
    run = cases[case]
    sample = SAMPLE if "sample" in case else None
    assert not (run / "rank1" / "grad_probe").exists()
    got = _summary(run)
    assert len(got) == 4 * STEPS
    reference = _numpy_reference(_arrays(run / "grads.npz"), sample)
    checked = 0
    for (name, step), want in reference.items():
        row = got.loc[(name, step)]
        assert row["numel"] == want["grad"].size and row["shape"] == str(list(_arrays(run / "grads.npz")[
            f"{step}|{name}"].shape))
        for column in STATS:
            if column == "cos_prev":
                continue  # without a sample: nan; with one: checked against the torch run below
            np.testing.assert_allclose(row[column], want[column], rtol=1e-5, atol=1e-7, equal_nan=True,
                                       err_msg=f"{case} {name} step {step} {column}")
        np.testing.assert_array_equal(_bits(run, step, name), want["bits"], err_msg=f"{case} {name} {step}")
        checked += 1
    assert checked == 4 * STEPS
    torch_run = out / ("torch8_sample" if sample else "torch8")
    want = _summary(torch_run)
    for column in STATS:
        np.testing.assert_allclose(got[column].to_numpy(float), want[column].to_numpy(float), rtol=1e-5, atol=1e-7,
                                   equal_nan=True, err_msg=f"{case} {column} vs the torch run")
    compare = out / f"cmp_{case}"
    assert cli_main(["grad-compare", str(torch_run), str(run), "-o", str(compare), "--no-plots"]) == 0
    sims = pd.read_csv(compare / "similarities.csv")
    assert (sims["kind"] == "param").sum() == 4 * STEPS and (sims["similarity"] == 1.0).all()
    assert not (compare / "problems.txt").exists()
    scalars = pd.read_csv(run / "rank0" / "scalars.csv")
    names = set(scalars["name"])
    assert {"grad_probe/sign_agree_exp_avg", "grad_probe/sign_agree_prev"} <= names
    if sample:
        assert "grad_probe/cos_prev" in names
    capsys.readouterr()


def test_two_ranks_one_gather_per_collected_step_and_none_otherwise(runs2):
    """The probe's only per-step collective is one gather per collected step (ZeRO-3, every step
    collected: 3; step_interval 2: steps 0 and 2 collected, 2 gathers, rows for those steps only)."""
    _, cases = runs2
    for case, want in (("z3_2r", STEPS), ("z3_2r_interval", 2)):
        run = cases[case]
        assert [int((run / f"gathers_rank{r}.txt").read_text()) for r in (0, 1)] == [want, want], case
    steps = _summary(cases["z3_2r_interval"]).index.get_level_values("step")
    assert sorted(set(steps)) == [0, 2]


def _numpy_hash(g: np.ndarray) -> str:
    """The documented L0 hash of a float32 gradient, its two checksums computed in numpy."""
    from trainmon.probe.storage import content_hash

    flat = g.astype(np.float32).ravel()
    raw = int(flat.view(np.int32).astype(np.int64).sum()) % 2**32
    raw = raw - 2**32 if raw >= 2**31 else raw
    packed = np.packbits(flat > 0, bitorder="little")
    words = np.zeros(-(-packed.size // 8) * 8, dtype=np.uint8)
    words[: packed.size] = packed
    weights = 2 * np.arange(1, words.size // 8 + 1, dtype=object) + 1
    signs = int(sum(int(w) * int(k) for w, k in zip(words.view("<u8"), weights))) % 2**64
    signs = signs - 2**64 if signs >= 2**63 else signs
    return content_hash("float32", list(g.shape), [flat.max(), flat.min()], raw, signs)


def test_two_ranks_zero3_l0_hash_equals_the_unsharded_hash(runs2):
    """L0 under ZeRO-3 on 2 ranks: each shard's checksum shares add up to the whole gradient's, so the
    content hash equals numpy's of the whole gradient DeepSpeed stepped with, as the unsharded torch
    run's hash equals numpy's of its gradient. (The two runs' gradients differ in their last bits:
    DeepSpeed averages two 4-row gradients, torch computes one 8-row gradient.)"""
    out, cases = runs2
    run = cases["z3_2r_l0"]
    got, want = _summary(run), _summary(out / "torch8_l0")
    assert list(got.index) == list(want.index) and len(got) == 4 * STEPS
    assert got["hash"].nunique() == len(got)
    for table, grads in ((got, _arrays(run / "grads.npz")), (want, _arrays(out / "torch8_l0" / "grads.npz"))):
        for key in list(grads):
            step, name = key.split("|", 1)
            assert table.loc[(name, int(step)), "hash"] == _numpy_hash(grads[key]), key
    for column in ("max", "min", "norm"):
        np.testing.assert_allclose(got[column].to_numpy(float), want[column].to_numpy(float), rtol=1e-5)


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
