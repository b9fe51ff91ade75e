"""FSDP2 (``fully_shard``) and HSDP on 2 gloo CPU ranks: shard statistics combined exactly, one collective.

The worker (``scripts/fsdp2_train.py``) trains a small residual MLP, each block ``fully_shard``ed then the
root, with Adam, gradient accumulation (2 micro-steps) and gradient clipping, every other step collected.
References are the test's own: ``full_tensor()`` of the gradients, parameters and Adam states the optimizer
used (captured in its own optimizer step pre/post hooks) and, for ``grad_unreduced``, a plain unsharded copy
of the model run on each rank's data. Everything is compared in float64 (rtol 1e-5).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.launch import child_env, free_port
from tests.reference import METRICS, adam_update_np, assert_close, np_stats, precursors_np, read_family

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fsdp2_train.py"
CASES = ("fsdp", "fsdp_nosync", "hsdp_1x2", "hsdp_2x1")
COLLECTED, UNCOLLECTED = (0, 2), (1, 3)
SHARD_FAMILIES = ("grad_reduced", "param", "exp_avg", "exp_avg_sq", "update", "ratio")
WRITERS = {"fsdp": (0,), "fsdp_nosync": (1,), "hsdp_1x2": (0,), "hsdp_2x1": (0, 1)}  # lowest selected of a shard group
SELECTED = {"fsdp_nosync": (1,)}  # config `ranks`; every rank otherwise
pytestmark = pytest.mark.slow


def _launch(args: list[str], world_size: int, timeout: float = 300.0) -> None:
    env = child_env(WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), *args], text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(world_size)]
    try:
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [p.returncode for p in procs] == [0] * world_size, "\n".join(o[-4000:] for o in outputs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2")
    _launch([str(out), *CASES], world_size=2)
    return out


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("fsdp2_unsupported")
    _launch([str(out), "unsupported"], world_size=1, timeout=120.0)
    return json.loads((out / "unsupported.json").read_text())


def _refs(path: Path) -> dict[str, np.ndarray]:
    """A worker's references, read whole (the file is closed even when an assertion fails later)."""
    with np.load(path) as npz:
        return dict(npz)


def _row(frame, name: str, step: int):
    rows = frame[(frame.name == name) & (frame.step == step)]
    assert len(rows) == 1, f"{name} step {step}: {len(rows)} rows"
    return rows.iloc[0]


@pytest.mark.parametrize("case", CASES)
def test_shard_rows_equal_full_tensors_written_by_the_shard_groups_lowest_rank(runs, case):
    refs = _refs(runs / case / "ref_rank0.npz")
    extra = json.loads((runs / case / "extra_rank0.json").read_text())
    betas, eps = extra["betas"], extra["eps"]
    names = sorted({key.split("|")[2] for key in refs if "|grad_reduced|" in key})
    assert "head.weight" in names and "blocks.1.fc2.bias" in names
    for rank in range(2):
        rank_dir = runs / case / f"rank{rank}"
        if rank not in WRITERS[case]:
            assert not any((rank_dir / f"{family}.csv").exists() for family in SHARD_FAMILIES)
            continue
        frames = {family: read_family(rank_dir, family) for family in SHARD_FAMILIES}
        for family, frame in frames.items():
            assert set(frame.step) == set(COLLECTED), (family, sorted(set(frame.step)))
        for step in COLLECTED:
            for name in names:
                label = f"{case} rank {rank} step {step} {name}"
                for family in ("grad_reduced", "param", "exp_avg", "exp_avg_sq"):
                    expected = np_stats(refs[f"{step}|{family}|{name}"])
                    assert_close(_row(frames[family], name, step), expected, METRICS, label=f"{label} {family}")
                update = adam_update_np(refs[f"{step}|exp_avg|{name}"], refs[f"{step}|exp_avg_sq|{name}"],
                                        float(refs[f"{step}|step|{name}"]), tuple(betas), eps)
                assert_close(_row(frames["update"], name, step), np_stats(update), METRICS, label=f"{label} update")
                after = refs[f"{step}|param_after|{name}"]
                ratio = np.divide(update, after, out=np.zeros_like(update), where=after != 0)
                assert_close(_row(frames["ratio"], name, step), np_stats(ratio), METRICS, label=f"{label} ratio")


@pytest.mark.parametrize("case", CASES)
def test_precursor_rows_equal_full_tensors(runs, case):
    """The ``precursors`` rows of the shards, combined in the step's one collective, against float64 from the full
    gradient, moments and weights (the update-to-weight ratio from the weights before and after the step)."""
    refs = _refs(runs / case / "ref_rank0.npz")
    extra = json.loads((runs / case / "extra_rank0.json").read_text())
    names = sorted({key.split("|")[2] for key in refs if "|grad_reduced|" in key})
    for rank in WRITERS[case]:
        frame = read_family(runs / case / f"rank{rank}", "precursors")
        assert set(frame.step) == set(COLLECTED) and len(frame) == len(COLLECTED) * len(names), case
        for step in COLLECTED:
            for name in names:
                ref = {key: refs[f"{step}|{key}|{name}"]
                       for key in ("grad_reduced", "exp_avg", "exp_avg_sq", "param", "param_after", "step")}
                want = precursors_np(ref["grad_reduced"], ref["exp_avg"], ref["exp_avg_sq"], ref["param_after"],
                                     float(ref["step"]), tuple(extra["betas"]), extra["eps"], extra["lr"],
                                     adam_step=ref["param"] - ref["param_after"])
                row = _row(frame, name, step)
                for metric, value in want.items():
                    assert np.isclose(row[metric], value, rtol=1e-3, atol=1e-7), (case, rank, step, name, metric,
                                                                                  row[metric], value)


def test_run_json_records_whose_rows_the_writers_are(runs):
    """The shard groups of two writing ranks are in run.json (write_replicated_once): readers give rank 1 rank 0's
    rows. With ``ranks: [1]`` or shard groups of one, every writing rank wrote its own: nothing is recorded."""
    groups = {"fsdp": [[0, 1]], "fsdp_nosync": [], "hsdp_1x2": [[0, 1]], "hsdp_2x1": []}
    for case, expected in groups.items():
        layout = json.loads((runs / case / "run.json").read_text())["replicated"]
        assert layout["groups"] == expected, case
        assert set(layout["families"]) == (set(SHARD_FAMILIES) | {"momentum", "precursors"} if expected else set()), \
            case


@pytest.mark.parametrize("case", CASES)
def test_grad_norm_is_the_pre_clip_norm_of_the_full_reduced_gradient_on_every_rank(runs, case):
    local = [_refs(runs / case / f"ref_rank{rank}.npz") for rank in range(2)]
    names = sorted({key.split("|")[2] for key in local[0] if "|local|" in key})
    for rank in SELECTED.get(case, (0, 1)):
        scalars = read_family(runs / case / f"rank{rank}", "scalars")
        norms = scalars[scalars.name == "grad_norm"]
        assert list(norms.step) == list(COLLECTED)
        for step in COLLECTED:
            want = float(local[rank][f"{step}|grad_norm|"])
            got = float(norms[norms.step == step].value.iloc[0])
            assert np.isclose(got, want, rtol=1e-5), (case, rank, step, got, want)
            assert want > 0.5, "clipping (max_norm 0.5) must be active for the pre-clip check to mean something"
            # independent of FSDP: the reduced gradient is the mean of the ranks' local (unsharded-copy) gradients
            mean = [(local[0][f"{step}|local|{n}"] + local[1][f"{step}|local|{n}"]) / 2 for n in names]
            assert np.isclose(got, np.sqrt(sum(np.sum(g * g) for g in mean)), rtol=1e-5)
            clipped = np.sqrt(sum(np.sum(local[rank][f"{step}|grad_reduced|{n}"] ** 2) for n in names))
            assert np.isclose(clipped, 0.5, rtol=1e-4), "grad_reduced is what the optimizer used: the clipped gradient"


@pytest.mark.parametrize("case", CASES)
def test_grad_unreduced_is_each_ranks_own_local_gradient_before_the_reduce_scatter(runs, case):
    # FSDP reduce-scatters after every micro-step: the last micro-step's gradient; under FSDP's no_sync the
    # unsharded gradient accumulates over the micro-steps until the reduction
    kind = "local" if case == "fsdp_nosync" else "local_last"
    for rank in SELECTED.get(case, (0, 1)):
        local = _refs(runs / case / f"ref_rank{rank}.npz")
        frame = read_family(runs / case / f"rank{rank}", "grad_unreduced")
        assert set(frame.step) == set(COLLECTED) and set(frame.micro_step) == {1}  # the last micro-step
        names = sorted({key.split("|")[2] for key in local if f"|{kind}|" in key})
        assert sorted(set(frame.name)) == names
        for step in COLLECTED:
            for name in names:
                assert_close(_row(frame, name, step), np_stats(local[f"{step}|{kind}|{name}"]), METRICS,
                             label=f"{case} rank {rank} step {step} {name} grad_unreduced")


@pytest.mark.parametrize("case", CASES)
def test_one_collective_per_collected_step_none_otherwise_no_warning_no_hook_left(runs, case):
    shard_size = {"fsdp": 2, "fsdp_nosync": 2, "hsdp_1x2": 2, "hsdp_2x1": 1}[case]
    for rank in range(2):  # a rank that `ranks` leaves out still joins the collective, and writes nothing
        if rank not in SELECTED.get(case, (0, 1)):
            assert not (runs / case / f"rank{rank}").exists()
        extra = json.loads((runs / case / f"extra_rank{rank}.json").read_text())
        expected = [int(shard_size > 1 and step in COLLECTED) for step in range(4)]
        assert extra["collectives"] == expected, (case, rank, extra["collectives"])
        assert not extra["hooks_left"]
        assert extra["unsharded_seen"] > 0  # the test saw FSDP's unsharded parameters (checked for hooks too)
        assert json.loads((runs / case / f"warnings_rank{rank}.json").read_text()) == []


@pytest.mark.parametrize("case", CASES)
def test_activation_rows_carry_the_users_module_names(runs, case):
    for rank in SELECTED.get(case, (0, 1)):
        rank_dir = runs / case / f"rank{rank}"
        actv, actv_grad = read_family(rank_dir, "actv"), read_family(rank_dir, "actv_grad")
        assert {"embed.output", "blocks.0.fc1.output", "blocks.1.norm.output", "head.output"} <= set(actv.name)
        assert {"blocks.0.fc2.output_grad", "head.output_grad"} <= set(actv_grad.name)
        assert not any("fsdp" in name.lower() for name in set(actv.name) | set(actv_grad.name))
        assert set(actv.step) == set(COLLECTED) and set(actv.micro_step) == {0, 1}
        assert (actv.norm > 0).all()


def test_unsupported_layouts_fail_at_attach_with_a_clear_message(refused):
    tensor_parallel = refused["tensor_parallel"]
    assert tensor_parallel.startswith("FSDPLayoutError: parameter '0.weight' has placements")
    assert "tensor-parallel mesh dimension" in tensor_parallel and "('dp', 'tp')" in tensor_parallel
    assert refused["plain_parameter"].startswith("FSDPLayoutError: parameter '1.weight' is a plain tensor")
    assert "fully_shard on the root module" in refused["plain_parameter"]
    assert refused["fsdp1"].startswith("FSDPLayoutError: FSDP1 (FullyShardedDataParallel) is not supported")
    for label in ("tensor_parallel", "plain_parameter", "fsdp1"):
        assert refused[f"{label}:hooks_left"] == "False" and refused[f"{label}:run_dir"] == "False", label
    assert refused["activations_only"] == "attached"  # nothing to combine: activations work on any layout
