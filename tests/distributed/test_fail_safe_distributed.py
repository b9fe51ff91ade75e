"""Fail-safe by construction under the distributed frameworks: trainmon's own exception injected into each kind of
hook (tests/faults.py) of DDP (gradient hooks, the collective wrapper, the end of the step), FSDP2 (the unsharded
parameters' pre-hook, the sharded optimizer states), Megatron-Core (the distributed optimizer's step hook, the
main_grad hooks, the end of the step with its cross-rank combination) and DeepSpeed ZeRO-2 (the engine's step
wrapper, the shards' all-gather at the end of the step). Every rank trains to the end, its parameters are
bit-identical to a run without trainmon, one warning per rank names the part, and failures.json records it."""

from __future__ import annotations

import json

import pytest

from tests.launch import ROOT, run_ranks

SCRIPT = ROOT / "tests" / "distributed" / "scripts" / "fail_safe_run.py"
CASES = [("ddp", "grad_hook"), ("ddp", "collective"), ("ddp", "step_end"),
         ("fsdp2", "fsdp_unsharded"), ("fsdp2", "fsdp_post_step"),
         ("megatron", "megatron_step"), ("megatron", "megatron_grad_hook"), ("megatron", "megatron_step_end"),
         ("deepspeed", "engine_step"), ("deepspeed", "engine_step_end")]


@pytest.mark.slow
@pytest.mark.parametrize(("framework", "kind"), CASES, ids=[f"{f}-{k}" for f, k in CASES])
def test_a_failing_hook_never_reaches_distributed_training(tmp_path, framework, kind):
    if framework == "megatron":
        pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    if framework == "deepspeed":
        pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    world = 1 if framework == "deepspeed" else 2
    run_ranks([SCRIPT, tmp_path, framework, kind], world_size=world, timeout=240)
    for rank in range(world):
        result = json.loads((tmp_path / f"result_rank{rank}.json").read_text())
        assert result["identical"], f"rank {rank}: the parameters differ from the run without trainmon"
        assert len(result["warnings"]) == 1, result["warnings"]
        assert result["warnings"][0].startswith(f"trainmon: {result['part']} failed (InjectedFault"), result
        assert [p["part"] for p in result["failures"]["parts"]] == [result["part"]]
