"""The step guard under DeepSpeed (``anomaly.guard``): a poisoned step goes through DeepSpeed's own overflow skip.

Each case (a ZeRO stage and dtype) trains TinyNet in a process of its own (tests/integration/scripts/ds_guard_run.py,
through tests/launch.py's warm fork servers): a reference run written as a user would leave the batch of step
``BAD`` out, and two guarded runs, one with a NaN in one entry of one micro-batch's gradient, one with a 10x loss
spike. The truth is the reference: every module parameter, fp32 master weight and Adam state
(``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``; ZeRO-0: the torch optimizer's own), every tensor
of the inner optimizer's state (flat partitions, step counts) and the learning rates (a DeepSpeed WarmupLR
scheduler) are equal bit for bit (``torch.equal``). The cases cover each way the verdict enters DeepSpeed's decision:
the torch optimizer of ZeRO-0 fp32 (host decision), the unfused wrapper of ZeRO-0 bf16, ZeRO 1/2, the BF16 optimizer
(ZeRO-1 bf16 with fp32 accumulation) and ZeRO-3; on 2 ranks (slow) ZeRO-2 and ZeRO-3 bf16.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

from tests.launch import ROOT, DeepSpeedCases

pytest.importorskip("deepspeed")

SCRIPT = ROOT / "tests" / "integration" / "scripts" / "ds_guard_run.py"
STEPS, BAD = 9, 6
NAN_PARAM = "layers.1.fc2.weight"
CASES = [  # one per way into DeepSpeed's skip
    {"name": "z0", "stage": 0, "unguarded": True, "reads": True},  # a torch optimizer: host decision, .overflow
    {"name": "z0_bf16", "stage": 0, "dtype": "bf16", "reads": True},  # FP16_UnfusedOptimizer: its overflow check
    {"name": "z1_bf16_fp32acc", "stage": 1, "dtype": "bf16", "accum": "fp32", "reads": True},  # BF16_Optimizer
    {"name": "z2", "stage": 2, "unguarded": True, "refusals": True, "reads": True},  # DeepSpeedZeroOptimizer
    {"name": "z3_bf16", "stage": 3, "dtype": "bf16", "reads": True},  # DeepSpeedZeroOptimizer_Stage3
]
ADDED_READS = {"z0": 1, "z0_bf16": 1}
"""Host reads the guard adds per step: ZeRO-0 fp32 decides on the host; ZeRO-0 bf16's unfused wrapper asks a host
bool of it (after DeepSpeed's own read). Everywhere else none."""
SLOW_CASES = [{"name": "z2_bf16", "stage": 2, "dtype": "bf16"}, {"name": "z3", "stage": 3}]
DP2_CASES = [{"name": "z2_dp2", "stage": 2}, {"name": "z3_dp2_bf16", "stage": 3, "dtype": "bf16"}]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Iterator[DeepSpeedCases]:
    cases = DeepSpeedCases(SCRIPT, CASES + SLOW_CASES, tmp_path_factory.mktemp("ds_guard"), world_size=1)
    yield cases
    cases.close()


@pytest.fixture(scope="module")
def runs_dp2(tmp_path_factory) -> Iterator[DeepSpeedCases]:
    cases = DeepSpeedCases(SCRIPT, DP2_CASES, tmp_path_factory.mktemp("ds_guard2"), world_size=2)
    yield cases
    cases.close()


def _result(run: Path, rank: int = 0) -> dict:
    return json.loads((run / f"result_rank{rank}.json").read_text())


def _guard_events(rank_dir: Path) -> list[dict]:
    lines = (rank_dir / "anomalies.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _check_case(run: Path, name: str, ranks: int = 1) -> None:
    """Both guarded runs equal the reference on every rank; each skipped step ``BAD`` once, through DeepSpeed."""
    for rank in range(ranks):
        result = _result(run, rank)
        assert result["reference"]["skipped_steps"] == 0 and result["reference"]["global_steps"] == STEPS - 1
        assert result["reference"]["compared"] > 60
        for mode in ("nan", "spike"):
            got = result[mode]
            assert got["differ"] == [], f"{name} {mode} rank {rank}: differs from the run without the batch"
            # DeepSpeed's own skip: counted by the engine, which still counts the step
            assert got["skipped_steps"] == 1 and got["global_steps"] == STEPS and got["finite"]
    for mode in ("nan", "spike"):
        messages = []
        for rank in range(ranks):
            rank_dir = run.parent / f"{name}_{mode}" / f"rank{rank}"
            scalars = pd.read_csv(rank_dir / "scalars.csv")
            skipped = scalars[scalars["name"] == "step_skipped"]
            assert list(skipped["step"]) == list(range(STEPS))  # every step, collected or not
            assert list(skipped[skipped["value"] == 1.0]["step"]) == [BAD]
            events = _guard_events(rank_dir)
            (event,) = [e for e in events if e["detector"] == "step_guard"]
            assert event["step"] == BAD and event["family"] == "grad_reduced" and event["metric"] == "norm"
            messages.append(event["message"].replace(f"rank {rank}", "rank R"))
            if mode == "nan":
                assert event["name"] == NAN_PARAM and event["value"] == "nan" and "(nonfinite)" in event["message"]
            else:
                assert "(z_score)" in event["message"]
                # the collected step's grad_norm is the norm the guard judged, not DeepSpeed's Inf of a skipped step
                norm = scalars[(scalars["name"] == "grad_norm") & (scalars["step"] == BAD)]["value"]
                assert len(norm) == 1 and 1.0 < float(norm.iloc[0]) < 1e6
                assert not [e for e in events if e["detector"] == "nonfinite"]
        assert len(set(messages)) == 1, messages  # the same verdict on every rank (whole-gradient norms)


@pytest.mark.parametrize("case", [case["name"] for case in CASES])
def test_a_poisoned_step_leaves_deepspeed_as_a_run_without_its_batch(runs, case):
    _check_case(runs[case], case)


def test_the_guard_judges_deepspeeds_global_norm(runs):
    """On applied steps the guard's global norm is the one DeepSpeed computes (``get_global_grad_norm()``):
    the same gradients, the same quantity (1e-6 relative: summation order)."""
    for case in ("z0_bf16", "z1_bf16_fp32acc", "z2", "z3_bf16"):
        pairs = _result(runs[case])["spike"]["norms"]
        assert len(pairs) == STEPS - 1, case
        for guard, deepspeed in pairs:
            assert abs(guard - deepspeed) <= 1e-6 * deepspeed, (case, guard, deepspeed)


@pytest.mark.parametrize("case", [case["name"] for case in CASES])
def test_host_reads_added_by_the_guard(runs, case):
    """Every host-synchronising tensor call of a training step (``item``, ``tolist``, ``__bool__``, ... from anyone:
    DeepSpeed's own overflow check included), with the guard off and on (a monitor collecting step 0 only)."""
    reads = _result(runs[case])["host_reads"]
    added = ADDED_READS.get(case, 0)
    assert reads["guarded"] == [count + added for count in reads["plain"]], reads


def test_without_the_guard_the_poison_reaches_the_weights_where_deepspeed_lets_it(runs):
    """The cases are not trivially true: unguarded, the spike changes every tensor. DeepSpeed itself skips the
    NaN step under ZeRO 1-3 (its norm check), but applies it under ZeRO-0 fp32 (no check there)."""
    z0, z2 = _result(runs["z0"]), _result(runs["z2"])
    assert not z0["unguarded_nan"]["finite"] and z0["unguarded_nan"]["skipped_steps"] == 0
    assert z2["unguarded_nan"]["differ"] == [] and z2["unguarded_nan"]["skipped_steps"] == 1
    for result in (z0, z2):
        spiked = result["unguarded_spike"]
        assert spiked["skipped_steps"] == 0 and len(spiked["differ"]) == spiked["compared"]


def test_a_failing_guard_applies_the_step_as_without_it(runs):
    """trainmon's guard code raising at step ``BAD`` (tests/faults.py): the spike is applied as by an unguarded
    run, with the fail-safe guard's one warning and the part in failures.json."""
    run = runs["z2"]
    got = _result(run)["failing_spike"]
    assert got["differ_unguarded_spike"] == [] and got["skipped_steps"] == 0
    failures = json.loads((run.parent / "z2_failing_spike" / "rank0" / "failures.json").read_text())
    assert [part["part"] for part in failures["parts"]] == ["step_guard"]


def test_set_ups_deepspeed_would_not_skip_exactly_are_refused(runs):
    refusals = _result(runs["z2"])["refusals"]
    assert "bf16.check_grad_overflow: false is not supported" in refusals["bf16_no_overflow_check"]
    assert "compute_grad_norm: false is not supported" in refusals["no_grad_norm"]
    for message in refusals.values():
        assert message.startswith("anomaly.guard is not supported with this deepspeed set-up")
        assert "docs/deepspeed.md, 'Step guard'" in message


@pytest.mark.slow
@pytest.mark.parametrize("case", [case["name"] for case in SLOW_CASES])
def test_other_stages_and_dtypes(runs, case):
    _check_case(runs[case], case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [case["name"] for case in DP2_CASES])
def test_two_ranks_skip_together_through_deepspeed(runs_dp2, case):
    """ZeRO-2 / ZeRO-3 on 2 ranks: the NaN on rank 1 and the spike on rank 0 are seen by both (shard norms summed
    over the data-parallel group): each rank's gathered state equals the reference."""
    _check_case(runs_dp2[case], case, ranks=2)
