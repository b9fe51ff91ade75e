"""Megatron-Core integration, for real on CPU: 2 processes with gloo, one torchrun for every case.

The script (scripts/mcore_monitor_run.py) trains a tiny GPTModel under TrainerMonitor in nine
layouts (and a ChainedOptimizer of two optimizers) and writes, next to the monitor's CSVs, independent float64
numpy references computed from the full tensors (TP shards concatenated, DP reduction redone in numpy, Adam recomputed).
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("megatron.core")

from tests.launch import child_env, torchrun
from tests.reference import written_by

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "mcore_monitor_run.py"
CASES = ("tp1", "tp1_distopt", "tp1_distopt_overlap", "tp1_bf16", "tp1_distopt_bf16", "tp1_bf16_grad16", "tp2",
         "tp2_diverged", "pp2", "vpp2", "tp1_chained")
BF16 = ("tp1_bf16", "tp1_distopt_bf16", "tp1_bf16_grad16")
# With overlap_grad_reduce the buckets are reduced during backward, so the script's snapshot in
# finalize_model_grads is no longer unreduced: that case is checked against "tp1" instead.
REFERENCED = tuple(case for case in CASES if case != "tp1_distopt_overlap")
METRICS = ("norm", "min", "max", "mean", "zeros", "nans", "infs")
PARAM_FAMILIES = ("grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq", "update", "ratio")
BF16_RTOL = 0.05  # bf16 has an 8-bit mantissa; measured deviations from fp32 are at most 3.5e-2


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("megatron")
    proc = subprocess.run(torchrun(SCRIPT, out, *CASES), env=child_env(), capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, _worker_errors(proc)
    return out


def _worker_errors(proc: subprocess.CompletedProcess) -> str:
    """The workers' own tracebacks (torchrun's summary at the end of stderr does not show them)."""
    lines = (proc.stdout + proc.stderr).splitlines()
    errors = [line for line in lines if line.startswith("[rank") or "Error" in line]
    return "\n".join(errors[-80:]) or "\n".join(lines[-80:])


def _read(runs: Path, case: str, rank: int, family: str) -> pd.DataFrame:
    """``rank``'s rows of ``family``: from the files of its data-parallel group's writer for a family written once
    per group (with DP=2 rank 0 writes the reduced gradients, parameters and Adam states for both ranks)."""
    writer = written_by(runs / case, rank, family)
    return pd.read_csv(runs / case / f"rank{writer}" / f"{family}.csv", keep_default_na=False, na_values=["nan"])


DP2 = ("tp1", "tp1_distopt", "tp1_distopt_overlap", "tp1_bf16", "tp1_distopt_bf16", "tp1_bf16_grad16", "tp1_chained")
"""The cases with two data-parallel ranks (the others have TP=2 or PP=2: DP=1)."""


def test_dp2_writes_what_the_replicas_share_once(runs: Path) -> None:
    """DP=2 (with and without the distributed optimizer): rank 1 writes no reduced gradient, parameter or Adam state
    (rank 0's are its rows: test_rows_match_numpy_float64_reference checks them against rank 1's own references),
    its own unreduced gradients yes; run.json says so. DP=1: every rank writes all it has."""
    shared = ("grad_reduced", "param", "exp_avg", "exp_avg_sq", "update", "ratio")
    for case in CASES:
        layout = json.loads((runs / case / "run.json").read_text())["replicated"]
        dp2 = case in DP2
        assert (layout["groups"], set(layout["families"]) >= set(shared)) == (([[0, 1]], True) if dp2 else ([], False))
        for family in shared:
            assert (runs / case / "rank1" / f"{family}.csv").exists() == (not dp2), (case, family)
        assert (runs / case / "rank1" / "grad_unreduced.csv").exists(), case


def _refs(runs: Path, case: str, rank: int) -> dict:
    return json.loads((runs / case / f"refs_rank{rank}.json").read_text())


def _close(got: float, want: float, rtol: float, scale: float, metric: str) -> bool:
    if math.isnan(want):
        return math.isnan(got)
    if metric == "mean":  # a mean near 0 is a cancelling fp32 sum: compare on the scale of the elements
        return abs(got - want) <= rtol * max(abs(want), scale) + 1e-7 * scale
    return abs(got - want) <= rtol * abs(want) + 1e-12


def _assert_row(row: pd.Series, ref: dict[str, float], rtol: float, label: str, skip: tuple[str, ...] = ()) -> None:
    scale = max(abs(ref["min"]), abs(ref["max"])) if not math.isnan(ref["min"]) else 1.0
    for metric in METRICS:
        if metric in skip:
            continue
        assert _close(float(row[metric]), ref[metric], rtol, scale, metric), (
            f"{label} {metric}: got {row[metric]!r}, want {ref[metric]!r}")


def _row(df: pd.DataFrame, step: int, vpp: int, name: str, micro: int | None = None) -> pd.Series:
    sel = (df.step == step) & (df.vpp_stage == vpp) & (df.name == name)
    if micro is not None:
        sel &= df.micro_step == micro
    rows = df[sel]
    assert len(rows) == 1, f"{len(rows)} rows for step {step} vpp {vpp} {name} micro {micro}"
    return rows.iloc[0]


@pytest.mark.parametrize("case", REFERENCED)
def test_rows_match_numpy_float64_reference(runs: Path, case: str) -> None:
    """Every parameter row of every rank equals float64 numpy on the full tensors (1e-5 relative)."""
    for rank in (0, 1):
        refs = _refs(runs, case, rank)
        # bf16: `ratio` divides by the fp32 main parameter, the script's reference by the bf16 model one.
        families = [f for f in PARAM_FAMILIES if not (case in BF16 and f == "ratio")] + ["actv"]
        for family in families:
            if family == "actv" and case in ("tp1", "tp1_distopt", "tp2", "tp2_diverged", "tp1_distopt_bf16",
                                             "tp1_bf16_grad16", "tp1_chained"):
                continue
            df = _read(runs, case, rank, family)
            checked = 0
            for step, step_refs in refs["steps"].items():
                for key, ref in step_refs[family].items():
                    vpp, name, *micro = key.split("|")
                    if family == "actv" and int(micro[0]) >= 2:
                        continue  # the script's probe also saw the recompute re-run (vpp2)
                    row = _row(df, int(step), int(vpp), name, int(micro[0]) if micro else None)
                    # Adam's update is elementwise fp32 arithmetic in torch: a looser tolerance, and its
                    # `zeros` (|x| < 1e-8) count flips for elements at the threshold.
                    adam = family in ("update", "ratio")
                    rtol, skip = (1e-4, ("zeros",)) if adam else (1e-5, ())
                    if case == "tp1_bf16_grad16" and family not in ("grad_unreduced", "actv"):
                        # Megatron all-reduces the bf16 main_grad in bf16, the reference in float64.
                        rtol, skip = BF16_RTOL, ("zeros",)
                    _assert_row(row, ref, rtol, f"{case} rank{rank} step{step} {family} {key}", skip=skip)
                    checked += 1
            assert checked, f"{case} rank{rank} {family}: nothing checked"


@pytest.mark.parametrize("case", [case for case in REFERENCED if case not in BF16])
def test_precursor_rows_match_numpy_float64_reference(runs: Path, case: str) -> None:
    """``precursors`` (TP shards, distributed-optimizer shards, pipeline stages, chained optimizers) against float64
    numpy from the full tensors: the reduced gradient, Adam recomputed, the full parameter after the step. (bf16:
    the precursors read the fp32 main parameter, the script's reference has only the bf16 model one.)"""
    from trainmon.base.precursors import PRECURSOR_METRICS

    for rank in (0, 1):
        refs = _refs(runs, case, rank)
        df = _read(runs, case, rank, "precursors")
        checked = 0
        for step, step_refs in refs["steps"].items():
            for key, ref in step_refs["precursors"].items():
                vpp, name = key.split("|")
                row = _row(df, int(step), int(vpp), name)
                for metric in PRECURSOR_METRICS:
                    assert math.isclose(float(row[metric]), ref[metric], rel_tol=1e-3, abs_tol=1e-6), \
                        (case, rank, step, key, metric, float(row[metric]), ref[metric])
                checked += 1
        assert checked, f"{case} rank{rank}: nothing checked"
        assert len(df) == checked, (case, rank, len(df), checked)


def _by_name(runs: Path, case: str, rank: int, family: str, step: int = 0) -> pd.DataFrame:
    df = _read(runs, case, rank, family)
    return df[df.step == step].set_index("name")[list(METRICS)]


@pytest.mark.parametrize("family", ["grad_reduced", "exp_avg", "exp_avg_sq", "update"])
def test_tp2_equals_tp1(runs: Path, family: str) -> None:
    """TP=2 (partitioned and replicated parameters) gives the statistics of the TP=1 run."""
    for step in (0, 1):
        tp1 = _by_name(runs, "tp1", 0, family, step)
        for rank in (0, 1):
            tp2 = _by_name(runs, "tp2", rank, family, step)
            assert sorted(tp2.index) == sorted(tp1.index)
            for name in tp1.index:
                want = tp1.loc[name]
                scale = max(abs(want["min"]), abs(want["max"]))
                for metric in METRICS:
                    if family == "update" and metric == "zeros":
                        continue  # threshold count on elementwise fp32 Adam arithmetic (see above)
                    rtol = 1e-4 if family == "update" else 1e-5
                    assert _close(tp2.loc[name, metric], want[metric], rtol, scale, metric), (family, name, metric)
    # TP=2 runs with DP=1: its unreduced gradient is the full-batch gradient, i.e. TP=1's reduced one.
    unreduced = _by_name(runs, "tp2", 1, "grad_unreduced")
    reduced = _by_name(runs, "tp1", 0, "grad_reduced")
    np.testing.assert_allclose(unreduced["norm"], reduced.loc[unreduced.index, "norm"], rtol=1e-5)


def test_diverged_tp_replicas_are_each_ranks_own(runs: Path) -> None:
    """Replicated parameters that differ between TP ranks (12% on rank 1): each rank's rows are its own replica's,
    equal to the float64 statistics of that rank's tensors (test_rows_match_numpy_float64_reference checks every
    row against them); here: the replicas' rows really differ, and partitioned ones are identical on both ranks.
    (A replica's gradient can be the same on both ranks: a layer norm's bias gradient is the sum of its output's
    gradient, which Megatron all-reduces over TP; most others differ.)"""
    for family in ("param", "grad_reduced", "exp_avg"):
        rank0, rank1 = (_by_name(runs, "tp2_diverged", rank, family) for rank in (0, 1))
        replicated = [name for name in rank0.index if "layernorm" in name or name.endswith("linear_proj.bias")]
        partitioned = [name for name in rank0.index if name.endswith("linear_fc1.weight")]
        assert replicated and partitioned
        differ = [name for name in replicated
                  if not np.isclose(rank0.loc[name, "norm"], rank1.loc[name, "norm"], rtol=1e-3)]
        assert differ == replicated if family == "param" else len(differ) >= len(replicated) // 2, (family, differ)
        pd.testing.assert_frame_equal(rank0.loc[partitioned], rank1.loc[partitioned])
    params = _refs(runs, "tp2_diverged", 1)["steps"]["0"]["grad_reduced"]
    assert any("layernorm" in key for key in params)


@pytest.mark.parametrize(("case", "plain_case"), [("tp1_distopt", "tp1"), ("tp1_distopt_overlap", "tp1"),
                                                   ("tp1_distopt_bf16", "tp1_bf16")])
def test_distributed_optimizer_equals_plain_ddp(runs: Path, case: str, plain_case: str) -> None:
    """DP=2 with the distributed optimizer (also with overlap_grad_reduce, and bf16 with its fp32 shards
    of the bf16 parameters): shards combine to the non-distributed statistics, and unreduced gradients
    are read before the overlapped reduction. The arithmetic is the same, so the tolerance is tight."""
    for rank in (0, 1):
        for family in PARAM_FAMILIES:
            for step in (0, 1):
                sharded = _by_name(runs, case, rank, family, step)
                plain = _by_name(runs, plain_case, rank, family, step)
                assert sorted(sharded.index) == sorted(plain.index)
                for name in plain.index:
                    scale = max(abs(plain.loc[name, "min"]), abs(plain.loc[name, "max"]))
                    for metric in METRICS:
                        assert _close(sharded.loc[name, metric], plain.loc[name, metric], 1e-5, scale, metric), (
                            family, rank, name, metric)
    # Combined rows are identical on both DP ranks (written once, by rank 0); unreduced ones differ (different data).
    assert not (runs / case / "rank1" / "exp_avg.csv").exists()
    assert not np.allclose(_by_name(runs, "tp1", 0, "grad_unreduced")["norm"],
                           _by_name(runs, "tp1", 1, "grad_unreduced")["norm"])


def test_chained_optimizer_of_two_equals_one(runs: Path) -> None:
    """A ChainedOptimizer of two FP32Optimizers (Megatron's two parameter groups, one each): every
    parameter's state is found in its own inner optimizer; rows equal the one-optimizer run."""
    for rank in (0, 1):
        for family in PARAM_FAMILIES + ("param",):
            for step in (0, 1):
                chained = _by_name(runs, "tp1_chained", rank, family, step)
                single = _by_name(runs, "tp1", rank, family, step)
                assert sorted(chained.index) == sorted(single.index), family
                pd.testing.assert_frame_equal(chained.loc[single.index], single, rtol=1e-6, obj=f"{family} {step}")
    lrs = pd.read_csv(runs / "tp1_chained" / "rank0" / "scalars.csv").name
    assert {"lr/group0", "lr/group1"} <= set(lrs)


@pytest.mark.parametrize("case", BF16)
def test_bf16_matches_fp32_reference(runs: Path, case: str) -> None:
    """bf16 with Float16Module (fp32 or bf16 main_grad, with and without the distributed optimizer):
    min/max/mean/norm of every parameter's gradients and Adam states are within bf16 tolerance of the
    fp32 run, on both ranks and both steps. A bf16 accumulation of the statistics would be far off
    (and the float64 reference test checks the bf16 main_grad's rows at 1e-5)."""
    for family in ("grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq", "update"):
        for rank in (0, 1):
            for step in (0, 1):
                bf16, fp32 = _by_name(runs, case, rank, family, step), _by_name(runs, "tp1", rank, family, step)
                assert sorted(bf16.index) == sorted(fp32.index)
                assert (bf16["nans"] == 0).all() and (bf16["infs"] == 0).all()
                for name in fp32.index:
                    if family == "update" and name.endswith("linear_qkv.bias"):
                        continue  # its key part has a zero true gradient: Adam normalises rounding noise
                    want = fp32.loc[name]
                    scale = max(abs(want["min"]), abs(want["max"]))
                    for metric in ("norm", "min", "max", "mean"):
                        got = bf16.loc[name, metric]
                        ok = abs(got - want[metric]) <= BF16_RTOL * max(abs(want[metric]), 1e-2 * scale) + 1e-12
                        if metric == "mean" or (family == "exp_avg_sq" and metric == "min"):
                            # a cancelling sum; the smallest of the squares: both on the elements' scale
                            ok = _close(got, want[metric], BF16_RTOL, scale, "mean")
                        assert ok, f"{case} rank{rank} step{step} {family} {name} {metric}: {got} vs {want[metric]}"
    scalars = pd.read_csv(runs / case / "rank0" / "scalars.csv")
    assert {"grad_norm", "loss_scale", "skipped_iter", "loss"} <= set(scalars.name)


def test_process_groups(runs: Path) -> None:
    """Explicit tp_group/pp_group are the groups used; a dp_group that differs from the distributed
    optimizer's group warns once (and the optimizer's group is used: see the bf16 comparison above)."""
    for rank in (0, 1):
        for case in ("tp2", "pp2"):  # fresh group objects passed to attach (also dp_group, equal to Megatron's)
            refs = _refs(runs, case, rank)
            assert refs["used_tp_group"] is True and refs["warnings"] == [], case
        (warning,) = _refs(runs, "tp1_distopt_bf16", rank)["warnings"]
        assert "dp_group" in warning and f"ranks [{rank}]" in warning and "ranks [0, 1]" in warning
        for case in CASES:
            if case != "tp1_distopt_bf16":
                assert _refs(runs, case, rank)["warnings"] == [], case


def test_scalars(runs: Path) -> None:
    """grad_norm is Megatron's (and the root of the sum of squared per-parameter norms)."""
    scalars = pd.read_csv(runs / "tp1" / "rank0" / "scalars.csv")
    refs = _refs(runs, "tp1", 0)["steps"]
    for step in (0, 1):
        values = scalars[scalars.step == step].set_index("name")["value"]
        assert values["grad_norm"] == pytest.approx(refs[str(step)]["grad_norm"], rel=1e-6)
        norms = _by_name(runs, "tp1", 0, "grad_reduced", step)["norm"]
        assert values["grad_norm"] == pytest.approx(float(np.sqrt((norms ** 2).sum())), rel=1e-5)
        assert values["loss_scale"] == 1.0 and values["skipped_iter"] == 0.0
    assert "loss" not in set(pd.read_csv(runs / "pp2" / "rank0" / "scalars.csv").name)  # not the last stage
    assert "loss" in set(pd.read_csv(runs / "pp2" / "rank1" / "scalars.csv").name)


# pp2's injected faults, one per step (see the script): (rank = stage, phase, micro-step, row)
PP2_ORIGINS = {1: (1, "forward", 0, "decoder.layers.0.mlp.output.0"),
               2: (0, "backward", 1, "decoder.layers.0.output_grad")}


def test_pipeline_micro_steps_and_anomaly_order(runs: Path, tmp_path: Path) -> None:
    """PP=2, 2 micro-batches: rows for both micro-steps per stage. A NaN injected in stage 1's forward
    (step 1) and one in stage 0's backward (step 2) are each reported as their step's first origin by
    ``trainmon analyse`` (API and CLI), with rank, stage, phase, micro-step and module."""
    run_dir = runs / "pp2"
    for rank in (0, 1):
        for family in ("actv", "actv_grad"):
            df = _read(runs, "pp2", rank, family)
            assert set(zip(df.step, df.micro_step)) == {(s, m) for s in range(3) for m in (0, 1)}, (rank, family)
            assert df.groupby(["step", "micro_step", "name"]).size().max() == 1
        lines = (run_dir / f"rank{rank}" / "anomalies.jsonl").read_text().splitlines()
        events = [json.loads(line) for line in lines]
        assert events and all(e["pp_stage"] == rank for e in events)
        assert {e["step"] for e in events} == ({1, 2} if rank == 0 else {1})  # stage 1 has no fault at step 2
        # Both faulty steps are skipped by Megatron (constant loss scale), so step 2 starts from clean weights.
        assert _refs(runs, "pp2", rank)["skipped"] == [1, 2]
        scalars = pd.read_csv(run_dir / f"rank{rank}" / "scalars.csv")
        skipped = scalars[scalars.name == "skipped_iter"].set_index("step")["value"]
        assert skipped.to_dict() == {0: 0.0, 1: 1.0, 2: 1.0}
    from trainmon.anomaly.merge import analyse_run
    from trainmon.tools.cli import main

    assert main(["analyse", str(run_dir)]) == 0
    assert main(["analyse", str(run_dir), "--steps", "2", "-o", str(tmp_path / "step2.json")]) == 0
    written = json.loads((run_dir / "anomaly_analyse.json").read_text())
    for analysis in (analyse_run(run_dir), written):
        firsts = {e["step"]: e for e in analysis["first_by_step"]}
        assert sorted(firsts) == [1, 2]
        for step, (stage, phase, micro, name) in PP2_ORIGINS.items():
            first = firsts[step]
            assert (first["rank"], first["pp_stage"], first["phase"], first["micro_step"], first["name"]) == (
                stage, stage, phase, micro, name), (step, first)
        assert analysis["first_origin"] == firsts[1]
        # Step 1's NaN reaches stage 0's backward of micro-step 0 too: ordered after stage 1's forward.
        ordered = [(e["step"], e["pp_stage"], e["phase"]) for e in analysis["top"]]
        assert ordered.index((1, 1, "forward")) < ordered.index((1, 0, "backward")) < ordered.index((2, 0, "backward"))
    for only_step2 in (analyse_run(run_dir, steps={2}), json.loads((tmp_path / "step2.json").read_text())):
        first = only_step2["first_origin"]
        assert (first["step"], first["rank"], first["phase"], first["name"]) == (2, 0, "backward", PP2_ORIGINS[2][3])


def test_virtual_pipeline_and_recompute(runs: Path) -> None:
    """VPP=2: each chunk's rows carry its vpp_stage; recompute re-runs are not measured twice."""
    for rank in (0, 1):
        actv = _read(runs, "vpp2", rank, "actv")
        assert set(actv.vpp_stage) == {0, 1}
        assert set(actv.micro_step) == {0, 1}  # the re-run during backward would have made 2 and 3
        assert actv.groupby(["vpp_stage", "step", "micro_step", "name"]).size().max() == 1
        refs = _refs(runs, "vpp2", rank)["steps"]["0"]["actv"]
        assert any(key.endswith("|3") for key in refs), "the recompute re-run did not happen"
        grads = _read(runs, "vpp2", rank, "actv_grad")
        assert set(grads.micro_step) == {0, 1} and set(grads.vpp_stage) == {0, 1}
        reduced = _read(runs, "vpp2", rank, "grad_reduced")
        assert set(reduced.vpp_stage) == {0, 1}
        assert "decoder.layers.0.mlp.linear_fc1.weight" in set(reduced[reduced.vpp_stage == 1].name)


def test_example_trains_with_the_monitor(tmp_path: Path) -> None:
    """examples/megatron_gpt.py: TP=2 on CPU (torchrun, 2 processes) writes the monitor's outputs."""
    cmd = torchrun(ROOT / "examples" / "megatron_gpt.py", "--tp", "2", "--steps", "2", "--out", tmp_path)
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, _worker_errors(proc)
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    from trainmon.tools.store import open_run  # the example writes the default output: the run store

    connection = open_run(run_dir)
    try:
        for rank in (0, 1):
            grads = connection.execute("SELECT * FROM grad_reduced WHERE rank = ?", [rank]).df()
            assert set(grads.step) == {0, 1} and np.isfinite(grads["norm"]).all()
            actv = connection.execute("SELECT micro_step FROM actv WHERE rank = ?", [rank]).df()
            assert set(actv.micro_step) == {0, 1}
    finally:
        connection.close()

