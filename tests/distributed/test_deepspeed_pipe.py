"""DeepSpeed ``PipelineEngine`` (``engine.train_batch``), PP=2 on 2 ranks (gloo, CPU), ZeRO 0 and 1.

Each case trains in 2 processes of its own (``tests/launch.py``), one pipeline stage per rank, with a weight
tied across the stages. References are taken by the script with DeepSpeed's public APIs
(``safe_get_full_grad`` in a step pre-hook of the torch optimizer DeepSpeed steps, the optimizer states after
``train_batch``, the loss ``train_batch`` returns, ``engine.get_global_grad_norm()``) and its own tensor hooks
for activation gradients; see ``scripts/ds_pipe_train.py``. The ``*_plain`` cases are the same runs without
trainmon: the parameters must be bit-identical.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from tests.launch import ROOT, DeepSpeedCases
from tests.reference import METRICS, adam_update_np, np_stats, read_family

pytest.importorskip("deepspeed")

SCRIPT = ROOT / "tests" / "distributed" / "scripts" / "ds_pipe_train.py"
GAS = 2
STEPS = 3
CASES = [
    {"name": "z0", "stage": 0, "gas": GAS, "grad_hooks": "module"},
    {"name": "z0_plain", "stage": 0, "gas": GAS, "monitor": False},
    {"name": "z1", "stage": 1, "gas": GAS, "grad_hooks": "tensor", "user_step": True},
    {"name": "z1_plain", "stage": 1, "gas": GAS, "monitor": False},
    # only rank 1 (stage 1) writes, every 2nd step: stage 0 still joins the ZeRO-0 norm's all_reduce
    {"name": "z0_rank1_interval", "stage": 0, "gas": GAS, "ranks": [1], "interval": 2},
]
MONITORED = ["z0", "z1"]
STAGE_LAYERS = {0: {"tied_modules.embed", "1", "2"}, 1: {"3", "tied_modules.embed", "5", "loss_fn"}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Iterator[DeepSpeedCases]:
    cases = DeepSpeedCases(SCRIPT, CASES, tmp_path_factory.mktemp("ds_pipe"), world_size=2)
    yield cases
    cases.close()


def _refs(run: Path, rank: int) -> np.lib.npyio.NpzFile:
    return np.load(run / f"ref_rank{rank}.npz")


def _extra(run: Path, rank: int) -> dict:
    return json.loads((run / f"extra_rank{rank}.json").read_text())


def _check_rows(table: pd.DataFrame, want: dict[tuple[str, int], np.ndarray], label: str) -> None:
    assert sorted(zip(table["name"], table["step"])) == sorted(want), label
    for _, row in table.iterrows():
        expected = np_stats(want[(row["name"], row["step"])])
        for metric in METRICS:
            atol = 1e-7 * expected["norm"] if metric == "mean" else 1e-8
            assert np.isclose(row[metric], expected[metric], rtol=1e-5, atol=atol), (label, row["name"], metric)


@pytest.mark.slow
@pytest.mark.parametrize("run", MONITORED)
def test_one_step_per_train_batch(runs, run):
    for rank in (0, 1):
        scalars = pd.read_csv(runs[run] / f"rank{rank}" / "scalars.csv")
        by_name = {name: group.set_index("step")["value"] for name, group in scalars.groupby("name")}
        assert list(by_name["global_steps"].index) == list(range(STEPS))
        assert by_name["global_steps"].tolist() == [1.0, 2.0, 3.0]  # engine.global_steps after each train_batch
        assert (by_name["step_skipped"] == 0).all() and (by_name["step_applied"] == 1).all()
        # the loss train_batch returned (the same value on both stages)
        assert np.allclose(by_name["loss"].to_numpy(), _extra(runs[run], rank)["losses"], rtol=1e-6, atol=0)
        for family in ("actv", "grad_reduced", "exp_avg"):
            assert sorted(read_family(runs[run] / f"rank{rank}", family)["step"].unique()) == list(range(STEPS))


@pytest.mark.slow
def test_pp_stage_of_each_rank(runs):
    for rank in (0, 1):
        extra = _extra(runs["z1"], rank)  # z1 calls monitor.step(loss=loss): its records come back
        assert extra["stage_id"] == rank and extra["pp_stages"] == [rank] * STEPS


@pytest.mark.slow
@pytest.mark.parametrize("run", MONITORED)
def test_reduced_gradients_params_and_states_match_deepspeed(runs, run):
    for rank in (0, 1):
        refs, rank_dir = _refs(runs[run], rank), runs[run] / f"rank{rank}"
        names = [str(n) for n in refs["names"]]
        steps = range(STEPS)
        _check_rows(read_family(rank_dir, "grad_reduced"),
                    {(n, s): refs[f"{s}/grad/{n}"] for n in names for s in steps}, f"{run}/{rank}/grad_reduced")
        _check_rows(read_family(rank_dir, "param"),
                    {(n, s): refs[f"{s}/param/{n}"] for n in names for s in steps}, f"{run}/{rank}/param")
        for key in ("exp_avg", "exp_avg_sq"):
            _check_rows(read_family(rank_dir, key), {(n, s): refs[f"{s}/{key}/{n}"] for n in names for s in steps},
                        f"{run}/{rank}/{key}")
        updates = {(n, s): adam_update_np(refs[f"{s}/exp_avg/{n}"], refs[f"{s}/exp_avg_sq/{n}"],
                                          float(refs[f"{s}/adam_step"]), (0.9, 0.999), 1e-8)
                   for n in names for s in steps}
        _check_rows(read_family(rank_dir, "update"), updates, f"{run}/{rank}/update")
        ratios = {}
        for (n, s), update in updates.items():
            after = refs[f"{s}/param_after/{n}"]
            ratios[(n, s)] = np.where(after != 0, update / np.where(after != 0, after, 1), 0)
        _check_rows(read_family(rank_dir, "ratio"), ratios, f"{run}/{rank}/ratio")


@pytest.mark.slow
@pytest.mark.parametrize("run", MONITORED)
def test_unreduced_gradient_is_the_last_micro_steps_accumulated_gradient(runs, run):
    """One row per parameter and step, at micro-step GAS-1: under 1F1B stage 0 runs both forwards before
    the first backward, so a backward labelled with the forward count would write micro-step 1 twice."""
    for rank in (0, 1):
        refs = _refs(runs[run], rank)
        table = read_family(runs[run] / f"rank{rank}", "grad_unreduced")
        assert (table["micro_step"] == GAS - 1).all()
        assert not table.duplicated(["name", "step"]).any()
        # the tied weight's reduced gradient is summed over the stages; every other one is this stage's own
        untied = table[~table["name"].str.startswith("tied_modules")]
        _check_rows(untied, {(n, s): refs[f"{s}/grad/{n}"] for n, s in zip(untied["name"], untied["step"])},
                    f"{run}/{rank}/grad_unreduced")


def _global_norms(run: Path) -> list[float]:
    """float64 norm of both stages' reduced gradients per step, a tied weight counted once."""
    grads = []
    for rank in (0, 1):
        refs = _refs(run, rank)
        replicated = dict(zip([str(n) for n in refs["names"]], refs["replicated"]))
        grads.append({s: [refs[f"{s}/grad/{n}"] for n, rep in replicated.items() if not rep] for s in range(STEPS)})
    return [np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for rank in grads for g in rank[s]))
            for s in range(STEPS)]


@pytest.mark.slow
@pytest.mark.parametrize("run", MONITORED)
def test_grad_norm_is_global_over_the_stages(runs, run):
    want = _global_norms(runs[run])
    for rank in (0, 1):
        scalars = pd.read_csv(runs[run] / f"rank{rank}" / "scalars.csv")
        got = scalars[scalars["name"] == "grad_norm"].sort_values("step")["value"].to_numpy()
        assert np.allclose(got, want, rtol=1e-5, atol=0), (rank, got, want)
        deepspeed_norm = _extra(runs[run], rank)["grad_norms"]  # nan: DeepSpeed computes none (ZeRO-0, torch Adam)
        if run == "z1":
            assert np.allclose(got, deepspeed_norm, rtol=1e-6, atol=0)
        else:
            assert np.isnan(deepspeed_norm).all()


@pytest.mark.slow
@pytest.mark.parametrize("run", MONITORED)
def test_activations_per_stage_and_micro_step(runs, run):
    """Stage-local module names; activation gradients labelled with the micro-batch of their forward, as the
    script's own tensor hooks saw them (module hooks in z0, tensor hooks in z1)."""
    for rank in (0, 1):
        rank_dir, extra = runs[run] / f"rank{rank}", _extra(runs[run], rank)
        actv = read_family(rank_dir, "actv")
        assert {name.rsplit(".", 1)[0] for name in actv["name"] if name.endswith(".output")} == STAGE_LAYERS[rank]
        assert sorted(actv["micro_step"].unique()) == list(range(GAS))
        grads = read_family(rank_dir, "actv_grad")
        outputs = grads[grads["name"].str.endswith(".output_grad")]
        got = {f"{r.step}/{r.micro_step}/{r.name}": r.norm for r in outputs.itertuples()}
        want = extra["activation_grads"]
        assert sorted(got) == sorted(want), rank
        for key, value in want.items():
            assert np.isclose(got[key], value, rtol=1e-5, atol=1e-9), (rank, key, got[key], value)


@pytest.mark.slow
@pytest.mark.parametrize("run,plain", [("z0", "z0_plain"), ("z1", "z1_plain")])
def test_training_is_bit_identical_to_an_unmonitored_run(runs, run, plain):
    for rank in (0, 1):
        monitored, reference = _refs(runs[run], rank), _refs(runs[plain], rank)
        for name in monitored["names"]:
            for step in range(STEPS):
                key = f"{step}/param_after/{name}"
                assert np.array_equal(monitored[key], reference[key]), (rank, key)
        assert _extra(runs[run], rank)["losses"] == _extra(runs[plain], rank)["losses"]


# ---------------------------------------------------------------------------------------------- refusals
def _fake_engine(slices: int = 1, checkpoint_interval: int = 0) -> SimpleNamespace:
    """Only what :func:`refusal` reads (a real engine with tensor slicing needs 4+ ranks and a Megatron mpu)."""
    grid = SimpleNamespace(get_slice_parallel_world_size=lambda: slices)
    module = SimpleNamespace(activation_checkpoint_interval=checkpoint_interval)
    return SimpleNamespace(grid=grid, module=module, train_batch=lambda: None, _take_model_step=lambda: None)


@pytest.mark.parametrize("engine,config,words", [
    (_fake_engine(slices=2), {}, ["tensor slicing", "Megatron-Core"]),
    (_fake_engine(checkpoint_interval=1), {"activations": {"enabled": True}},
     ["activation checkpointing", "activations.enabled: false"]),
    (_fake_engine(), {"grad_probe": {"enabled": True}}, ["grad_probe", "grad_probe.enabled: false"]),
])
def test_unsupported_pipeline_set_ups_are_refused_with_the_alternative(engine, config, words):
    from trainmon.config import load_config
    from trainmon.integrations.deepspeed.pipe import refusal

    reason = refusal(engine, load_config(config))
    assert reason is not None and all(word in reason for word in words), reason


def test_checkpointing_without_activations_is_accepted():
    from trainmon.config import load_config
    from trainmon.integrations.deepspeed.pipe import refusal

    assert refusal(_fake_engine(checkpoint_interval=1), load_config({})) is None


@pytest.mark.slow
def test_selected_rank_and_interval(runs):
    run = runs["z0_rank1_interval"]
    assert not (run / "rank0").exists()  # stage 0 is not selected: no files, but it joined the norm's all_reduce
    scalars = pd.read_csv(run / "rank1" / "scalars.csv")
    norms = scalars[scalars["name"] == "grad_norm"].set_index("step")["value"]
    assert list(norms.index) == [0, 2]
    assert np.allclose(norms.to_numpy(), [_global_norms(run)[s] for s in (0, 2)], rtol=1e-5, atol=0)
    assert sorted(read_family(run / "rank1", "grad_reduced")["step"].unique()) == [0, 2]
