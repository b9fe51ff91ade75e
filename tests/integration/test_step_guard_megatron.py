"""The step guard under Megatron-Core (``anomaly.guard``): a poisoned step is skipped as Megatron skips an overflow,
and the guard's judgement feeds Megatron's rerun state machine.

Each case trains a tiny GPTModel in processes of its own (tests/integration/scripts/mcore_guard_run.py, forked from
warm servers), as Megatron-LM's ``train_step`` does (an ``OptimizerParamScheduler`` stepped when
``update_successful``). The truth is a run written as a user would leave the batch of step ``BAD`` out: the model
parameters, every leaf optimizer's main parameters (fp32 copies, distributed-optimizer shards) and every tensor of
its torch optimizer's state (moments, step counts) and the learning rates are equal bit for bit (``torch.equal``),
after a NaN in one entry of one micro-batch's gradient or a 10x loss spike; ``optimizer.step()`` returned
``update_successful`` False at ``BAD`` only. The rerun cases check the state machine's own outcomes and exit codes
(16, 17) with :class:`~trainmon.integrations.megatron.rerun.RerunValidation` as a ``validate_result`` source.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("megatron.core")

SCRIPT = Path(__file__).parent / "scripts" / "mcore_guard_run.py"
PRELOAD = ("numpy", "pandas", "torch", "megatron.core", "megatron.core.models.gpt.gpt_model",
           "megatron.core.optimizer", "megatron.core.pipeline_parallel", "megatron.core.rerun_state_machine",
           "trainmon")
STEPS, BAD = 9, 6
NAN_PARAM = "decoder.layers.1.mlp.linear_fc2.weight"
GUARDED = ["reference", "nan", "spike"]
RERUN = ["reference", "reference_stop", "clean", "rerun_transient_nan", "rerun_persistent_nan", "rerun_spike",
         "rerun_transient_spike", "rerun_disabled_nan"]
CASES = {
    # a ChainedOptimizer of one FP32Optimizer
    "fp32": dict(world=1, runs=[*GUARDED, "unguarded_nan", "unguarded_spike", "failing_spike"], refusals=True,
                 reads=True),
    "bf16_distopt": dict(world=1, bf16=True, distopt=True, runs=GUARDED),  # DistributedOptimizer, fp32 shards
    "rerun": dict(world=1, runs=RERUN),
    "bf16_leaf": dict(world=1, bf16=True, chained=False, runs=GUARDED),  # a bare Float16OptimizerWithFloat16Params
    "dp2_distopt": dict(world=2, distopt=True, runs=GUARDED),  # shards over 2 data-parallel ranks
    "tp2": dict(world=2, tp=2, runs=[*GUARDED, "rerun_spike"]),  # partitions over 2 tensor-parallel ranks
}
APPLIED_BUT_BAD = [True] * BAD + [False] + [True] * (STEPS - BAD - 1)


class _Runs:
    """Each case trained on first use in processes forked from warm servers (one per world size)."""

    def __init__(self, out: Path) -> None:
        from tests.launch import RankServers

        self.out = out
        self.servers = {n: RankServers(n, PRELOAD, out / f"_servers{n}") for n in (1, 2)}
        self.failed: dict[str, str] = {}

    def __getitem__(self, name: str) -> Path:
        if name in self.failed:
            pytest.fail(f"case {name} failed (earlier):\n{self.failed[name][-3000:]}", pytrace=False)
        run = self.out / name
        if not (run / "done").exists():
            case = {"name": name, **{k: v for k, v in CASES[name].items() if k != "world"}}
            ok, output = self.servers[CASES[name]["world"]].run([SCRIPT, self.out, json.dumps(case)],
                                                                self.out / "_logs" / name, timeout=400)
            if not ok:
                self.failed[name] = output
                pytest.fail(f"case {name} failed:\n{output[-6000:]}", pytrace=False)
            (run / "done").touch()
        return run

    def close(self) -> None:
        for servers in self.servers.values():
            servers.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Iterator[_Runs]:
    cases = _Runs(tmp_path_factory.mktemp("mcore_guard"))
    yield cases
    cases.close()


def _result(run: Path, rank: int = 0) -> dict:
    return json.loads((run / f"result_rank{rank}.json").read_text())


def _check_guarded(run: Path, name: str, ranks: int) -> None:
    for rank in range(ranks):
        result = _result(run, rank)
        assert result["reference"]["compared"] > 50
        for mode in ("nan", "spike"):
            got = result[mode]
            assert got["differ_reference"] == [], f"{name} {mode} rank {rank}: differs from the run without the batch"
            assert got["successes"] == APPLIED_BUT_BAD and got["finite"]  # Megatron's skip: update_successful False
    for mode in ("nan", "spike"):
        messages = []
        for rank in range(ranks):
            rank_dir = run.parent / f"{name}_{mode}" / f"rank{rank}"
            scalars = pd.read_csv(rank_dir / "scalars.csv")
            skipped = scalars[scalars["name"] == "step_skipped"]
            assert list(skipped["step"]) == list(range(STEPS))  # every step, collected or not
            assert list(skipped[skipped["value"] == 1.0]["step"]) == [BAD]
            events = [json.loads(line) for line in (rank_dir / "anomalies.jsonl").read_text().splitlines()]
            (event,) = [e for e in events if e["detector"] == "step_guard"]
            assert event["step"] == BAD and event["family"] == "grad_reduced" and event["metric"] == "norm"
            messages.append(event["message"].replace(f"rank {rank}", "rank R"))
            if mode == "nan":
                assert event["name"] == NAN_PARAM and event["value"] == "nan" and "(nonfinite)" in event["message"]
            else:
                assert "(z_score)" in event["message"]
        assert len(set(messages)) == 1, messages  # the same verdict on every rank (whole-parameter norms)


@pytest.mark.parametrize("case", ["fp32", "bf16_distopt"])
def test_a_poisoned_step_leaves_megatron_as_a_run_without_its_batch(runs, case):
    _check_guarded(runs[case], case, ranks=1)


def test_the_guard_judges_megatrons_global_norm(runs):
    """On applied steps the guard's global norm is the pre-clip norm ``optimizer.step()`` returns (1e-6 relative:
    summation order and fp32 versus Megatron's float64 host sum)."""
    for case in ("fp32", "bf16_distopt"):
        pairs = _result(runs[case])["spike"]["norms"]
        assert len(pairs) == STEPS - 1, case
        for guard, megatron in pairs:
            assert abs(guard - megatron) <= 1e-6 * megatron, (case, guard, megatron)


def test_without_the_guard_the_poison_reaches_the_weights(runs):
    result = _result(runs["fp32"])
    assert not result["unguarded_nan"]["finite"]  # Megatron without a loss scaler checks nothing
    for mode in ("unguarded_nan", "unguarded_spike"):
        assert result[mode]["successes"] == [True] * STEPS
        assert len(result[mode]["differ_reference"]) == result[mode]["compared"]


def test_a_failing_guard_applies_the_step_as_without_it(runs):
    """trainmon's guard code raising at step ``BAD`` (tests/faults.py): the spike is applied as by an unguarded
    run, and failures.json names the part."""
    run = runs["fp32"]
    got = _result(run)["failing_spike"]
    assert got["differ_unguarded_spike"] == [] and got["successes"] == [True] * STEPS
    failures = json.loads((run.parent / "fp32_failing_spike" / "rank0" / "failures.json").read_text())
    assert [part["part"] for part in failures["parts"]] == ["step_guard"]


def test_one_host_read_per_step(runs):
    """Every host-synchronising tensor call of a training step (Megatron's own, e.g. its grad norm's ``item()``,
    included), with the guard off and on: the guard adds its one read of the verdict (``prepare_grads`` returns a
    Python bool)."""
    reads = _result(runs["fp32"])["host_reads"]
    assert reads["guarded"] == [count + 1 for count in reads["plain"]], reads


def test_set_ups_the_guard_cannot_hold_back_are_refused(runs):
    refusals = _result(runs["fp32"])["refusals"]
    assert "a loss scaler (fp16, or loss_scale set) is not supported" in refusals["loss_scale"]
    assert "pass the Megatron optimizer" in refusals["torch_optimizer_over_ddp"]
    assert refusals["torch_optimizer"] == "not refused"  # chunks without Megatron's DDP: the torch guard
    for name in ("loss_scale", "torch_optimizer_over_ddp"):
        assert refusals[name].startswith("anomaly.guard is not supported with this megatron set-up")
    assert "RerunValidation needs the step guard" in refusals["rerun_without_guard"]


def test_rerun_state_machine_outcomes(runs):
    """The guard's verdict as a ``validate_result`` source, in ``validate_results`` mode:

    - a NaN in the first run of step ``BAD`` only: not reproduced in place, fatal: exit 17 (failed validation);
      nothing of step ``BAD`` applied;
    - a NaN in every run of it: reproduced, fatal: exit 16 (resume from the checkpoint to disambiguate);
    - a spike in every run: reproduced, not fatal: training goes on and the guard skips the step (the state of the
      run without the batch);
    - a spike in the first run only: not reproduced, not fatal: the re-run's clean gradients are applied (the state
      of the run without any poison);
    - ``disabled`` mode: ``validate_result`` raises Megatron's own RuntimeError on the fatal NaN."""
    result = _result(runs["rerun"])
    for mode, code in (("rerun_transient_nan", 17), ("rerun_persistent_nan", 16)):
        got = result[mode]
        assert got["exit_code"] == code and got["differ_reference_stop"] == [], mode
        assert got["successes"] == [True] * BAD and got["first_runs"] == [True] * (BAD + 1) + [False]
    spike = result["rerun_spike"]
    assert spike["exit_code"] is None and spike["differ_reference"] == [] and spike["successes"] == APPLIED_BUT_BAD
    assert spike["first_runs"].count(False) == 1  # step BAD ran twice
    transient = result["rerun_transient_spike"]
    assert transient["differ_clean"] == [] and transient["successes"] == [True] * STEPS
    disabled = result["rerun_disabled_nan"]
    assert "trainmon step guard: non-finite gradient norm" in disabled["error"]
    assert disabled["differ_reference_stop"] == []


@pytest.mark.slow
def test_a_bare_leaf_optimizer(runs):
    _check_guarded(runs["bf16_leaf"], "bf16_leaf", ranks=1)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dp2_distopt", "tp2"])
def test_two_ranks_skip_together(runs, case):
    """DP=2 with the distributed optimizer (shard norms summed over its data-parallel group) and TP=2 (partitions
    summed over the TP group, replicated parameters counted once): both ranks skip ``BAD`` and equal the
    reference; under TP=2 the rerun validation agrees on both ranks as well."""
    _check_guarded(runs[case], case, ranks=2)
    if case == "tp2":
        for rank in range(2):
            spike = _result(runs[case], rank)["rerun_spike"]
            assert spike["differ_reference"] == [] and spike["successes"] == APPLIED_BUT_BAD
