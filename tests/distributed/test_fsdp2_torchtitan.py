"""A torchtitan-style loop on 2 gloo CPU ranks: FSDP2 per block and root, blocks compiled in place with
``fullgraph=True``, activation checkpointing, torchtitan's ``OptimizersContainer`` (two inner optimizers),
gradient accumulation, clipping and a scheduler; float32, and bf16 ``MixedPrecisionPolicy``. The same loop
with ``torch.compile(block)`` wrappers under ``fully_shard``, and with the whole FSDP model compiled.

The worker (``scripts/fsdp2_torchtitan.py``, which says why the backend is ``aot_eager``) trains each case
monitored and unmonitored from the same seed. References are the test's own, in float64: ``full_tensor()`` of
the gradients the container stepped with and of every inner optimizer's ``exp_avg``/``exp_avg_sq`` (read in the
container's own step hooks), the inner optimizers' learning rates, and each rank's own gradient from a plain
eager copy of the model on its data (float32 cases).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.launch import run_ranks
from tests.reference import METRICS, assert_close, np_stats, read_family

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fsdp2_torchtitan.py"
TITAN = ("titan", "shard_then_compile", "titan_bf16")
WRAPPERS = ("wrapped_blocks", "whole_model", "compile_after_attach")  # a launch of their own (each under a minute)
CASES = TITAN + WRAPPERS


def collected(case: str) -> tuple[int, ...]:
    """4 steps, every other one collected; every one where the blocks are compiled after attach (before step 2)."""
    return (0, 1, 2, 3) if case == "compile_after_attach" else (0, 2)

FAMILIES = ("grad_reduced", "exp_avg", "exp_avg_sq")


def _launch(tmp_path_factory: pytest.TempPathFactory, cases: tuple[str, ...]) -> Path:
    out = tmp_path_factory.mktemp("fsdp2_torchtitan")
    run_ranks([SCRIPT, out, *cases], world_size=2, timeout=300.0)
    return out


@pytest.fixture(scope="module")
def titan_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _launch(tmp_path_factory, TITAN)


@pytest.fixture(scope="module")
def wrapper_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _launch(tmp_path_factory, WRAPPERS)


@pytest.fixture
def runs(request: pytest.FixtureRequest, case: str) -> Path:
    """The output folder of the launch that ran ``case`` (each launch runs once, when a test first needs it)."""
    return request.getfixturevalue("titan_runs" if case in TITAN else "wrapper_runs")


def _info(runs: Path, case: str, rank: int = 0) -> dict:
    info = json.loads((runs / case / f"info_rank{rank}.json").read_text())
    if "skipped" in info:
        pytest.skip(info["skipped"])
    return info


def _refs(runs: Path, case: str, rank: int = 0) -> dict[str, np.ndarray]:
    with np.load(runs / case / f"refs_rank{rank}.npz") as npz:
        return dict(npz)


def _row(frame, name: str, step: int):
    rows = frame[(frame.name == name) & (frame.step == step)]
    assert len(rows) == 1, f"{name} step {step}: {len(rows)} rows"
    return rows.iloc[0]


@pytest.mark.parametrize("case", CASES)
def test_gradients_and_states_of_every_inner_optimizer_equal_the_full_tensors(runs, case):
    info, refs = _info(runs, case), _refs(runs, case)
    names = info["names"]
    assert len(info["inner_params"]) == 2 and sum(map(len, info["inner_params"])) == len(names)
    for family in FAMILIES:  # rank 0 writes the rows combined over the shard group; rank 1 none
        frame = read_family(runs / case / "rank0", family)
        assert set(frame.step) == set(collected(case)), (family, sorted(set(frame.step)))
        assert sorted(set(frame.name)) == sorted(names), family
        assert not (runs / case / "rank1" / f"{family}.csv").exists()
        for step in collected(case):
            for name in names:
                assert_close(_row(frame, name, step), np_stats(refs[f"{step}|{family}|{name}"]), METRICS,
                             label=f"{case} step {step} {name} {family}")
    for family in ("update", "ratio"):
        assert sorted(set(read_family(runs / case / "rank0", family).name)) == sorted(names), family


@pytest.mark.parametrize("case", CASES)
def test_learning_rates_of_the_inner_optimizers_and_the_pre_clip_grad_norm(runs, case):
    info, refs = _info(runs, case), _refs(runs, case)
    for rank in range(2):
        scalars = read_family(runs / case / f"rank{rank}", "scalars")
        for step in collected(case):
            at = scalars[scalars.step == step].set_index("name").value
            # lr/group{i} counts through the inner optimizers' groups; the scheduler moves inner optimizer 0 only
            assert at["lr/group0"] == pytest.approx(info["lr"][f"{step}|0|0"], rel=1e-12)
            assert at["lr/group1"] == pytest.approx(info["lr"][f"{step}|1|0"], rel=1e-12)
            want = float(refs[f"{step}|grad_norm|"])
            assert want > 1.0, "clipping (max_norm 1.0) must be active for the pre-clip check to mean something"
            assert np.isclose(at["grad_norm"], want, rtol=1e-5), (case, rank, step, at["grad_norm"], want)
    assert info["lr"]["2|0|0"] != info["lr"]["0|0|0"]


@pytest.mark.parametrize("case", CASES)
def test_grad_unreduced_of_the_compiled_blocks_is_each_ranks_own_gradient(runs, case):
    info = _info(runs, case)
    for rank in range(2):
        frame = read_family(runs / case / f"rank{rank}", "grad_unreduced")
        assert set(frame.step) == set(collected(case)) and set(frame.micro_step) == {1}  # the last micro-step
        assert sorted(set(frame.name)) == sorted(info["names"])  # the compiled blocks' parameters too
        if case.endswith("bf16"):
            continue  # the plain copy would not compute in bf16 as FSDP's unsharded parameters do
        refs = _refs(runs, case, rank)
        for step in collected(case):
            for name in info["names"]:
                want = refs[f"{step}|local|{name}"]
                assert_close(_row(frame, name, step), np_stats(want), METRICS, rtol=1e-4, atol=1e-6,
                             label=f"{case} rank {rank} step {step} {name} grad_unreduced")


@pytest.mark.parametrize("case", CASES)
def test_training_is_bit_identical_and_nothing_recompiles(runs, case):
    for rank in range(2):
        info = _info(runs, case, rank)
        assert info["bit_identical"], f"rank {rank}: parameters differ from the unmonitored run"
        # no hook of trainmon's inside the compiled blocks: arming and disarming the collected steps' hooks
        # compiles nothing again (compile_after_attach: after the step that first ran the blocks compiled)
        assert info["monitored"]["graphs_after_first"] == 0 == info["unmonitored"]["graphs_after_first"]
        assert info["monitored"]["graphs"] == info["unmonitored"]["graphs"]
        if case not in ("shard_then_compile", "wrapped_blocks", "compile_after_attach"):
            assert info["warnings"] == []


@pytest.mark.parametrize("case", ("shard_then_compile", "wrapped_blocks"))
def test_activations_inside_compiled_blocks_are_dropped_with_a_warning_that_tells_the_truth(runs, case):
    info = _info(runs, case)
    warnings = [w for w in info["warnings"] if "torch.compile" in w]
    assert len(warnings) == 1 and len(info["warnings"]) == 1, info["warnings"]
    assert "'layers.0', 'layers.1'" in warnings[0] and "layers.0.w1" in warnings[0]
    assert "weight gradients, optimizer states and parameters are recorded" in warnings[0]
    actv = read_family(runs / case / "rank0", "actv")
    assert set(actv.step) == set(collected(case))
    assert {"tok_embeddings.output", "norm.output", "output.output"} <= set(actv.name)
    assert not any(name.startswith("layers") for name in actv.name)


def test_blocks_compiled_after_attach_lose_their_hooks_before_their_compiled_code_runs(wrapper_runs):
    case = "compile_after_attach"
    info = _info(wrapper_runs, case)
    warnings = [w for w in info["warnings"] if "torch.compile" in w]
    assert len(warnings) == 1 and len(info["warnings"]) == 1 and "'layers.0', 'layers.1'" in warnings[0]
    actv = read_family(wrapper_runs / case / "rank0", "actv")
    for step in collected(case):  # uncompiled blocks' activations until the step that first runs them compiled
        names = set(actv[actv.step == step].name)
        assert {"tok_embeddings.output", "output.output"} <= names
        assert any(name.startswith("layers.0.w1") for name in names) == (step < 2), (step, sorted(names))
